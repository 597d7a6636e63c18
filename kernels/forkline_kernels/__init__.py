"""Quantized matmul, attention, fused decoder-layer, K/V store and sampling kernels for MLX's CPU backend (a
compiled MLX extension; formats and contracts in ``src/*.h``), bitwise independent of ISA and threads.
Importing raises ImportError when the extension is missing or built against another mlx."""

from __future__ import annotations

import mlx.core as mx  # first: the extension shares mlx.core's nanobind types (NB_DOMAIN mlx)

from forkline_kernels import _ext

if _ext.built_with_mlx != mx.__version__:
    raise ImportError(
        f"forkline_kernels was built against mlx {_ext.built_with_mlx}, mlx {mx.__version__} is installed; "
        "rebuild it: pip install --no-build-isolation ./kernels"
    )

q8_0_matmul = _ext.q8_0_matmul
causal_attention = _ext.causal_attention
fused_linear = _ext.fused_linear
fused_qkv = _ext.fused_qkv
kv_store = _ext.kv_store
DecoderLayer = getattr(_ext, "DecoderLayer", None)  # one op a layer (src/decoder_layer.h)
categorical = _ext.categorical
q4_1_matmul = _ext.q4_1_matmul
isa = _ext.isa
best_isa = _ext.best_isa
set_isa = _ext.set_isa
set_num_threads = _ext.set_num_threads
num_threads = _ext.num_threads
pool_tuning = _ext.pool_tuning
set_pool_tuning = _ext.set_pool_tuning
built_with_mlx = _ext.built_with_mlx
attention_groups = getattr(_ext, "attention_groups", False)  # causal_attention(..., groups=...)

__all__ = [
    "DecoderLayer",
    "attention_groups",
    "best_isa",
    "built_with_mlx",
    "categorical",
    "causal_attention",
    "fused_linear",
    "fused_qkv",
    "isa",
    "num_threads",
    "pool_tuning",
    "q4_1_matmul",
    "q8_0_matmul",
    "set_isa",
    "set_num_threads",
    "set_pool_tuning",
]
