"""Quantized matmul and attention kernels for MLX's CPU backend (a compiled MLX extension).

``q8_0_matmul(x, wq, scales)`` and ``q4_1_matmul(x, wq, scales, mins)`` compute ``x @ W.T`` for
block-quantized W (formats in ``src/qdot.h``) as one MLX op; ``causal_attention(q, q_pos, keys,
values, key_pos, scale=...)`` is batch-invariant attention over any number of cache parts, float32 /
float16 / bfloat16 K/V read as stored (``src/attention.h``); ``fused_linear`` / ``fused_qkv`` are the
matmuls with a decoder layer's elementwise work fused in (RMSNorm before, gating / post-norm / residual
or QK-norm and RoPE after: ``src/fused.h``); ``kv_store`` writes a layer's new K/V rows into a step's
cache buffers in one op (``src/kv_store.h``). Every result is bitwise independent of the
ISA (``isa()``: avx512 / avx2 / scalar), the thread count and the pool policy (``set_pool_tuning``,
``src/pool.h``). Importing raises ImportError when the extension is missing or was built against
another mlx version than the one installed (MLX's C++ ABI changes between releases); callers fall
back to float32.
"""

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
    "attention_groups",
    "best_isa",
    "built_with_mlx",
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
