"""GGUF model files: hyper-parameters from ``llama.*`` metadata, tensors in canonical names.

``mx.load(path, return_metadata=True)`` returns F32/F16 tensors as float arrays and Q4_0/Q4_1/Q8_0
tensors as MLX affine quantization (``name.weight`` uint32, ``name.scales``, ``name.biases``, group
size 32). Q/K rows stay in GGUF's per-head permuted order, so the config asks for traditional RoPE.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from engine_service.errors import ModelLoadError
from engine_service.model.config import ModelConfig, layer_specs
from engine_service.model.gguf_header import check_gguf
from engine_service.model.weights import QuantTensor, named_tensor

SUPPORTED_ARCHITECTURES = ("llama",)

_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}


def scalar(value: Any) -> Any:
    """Metadata scalars come back as 0-d mx.arrays; lists and strings as Python values."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def read_gguf(path: str) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Validated ``mx.load`` of a GGUF: (raw tensors, metadata with Python scalars)."""
    check_gguf(path)
    try:
        raw, metadata = mx.load(path, return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise ModelLoadError(path, f"MLX cannot read it: {exc}") from None
    return raw, {k: scalar(v) for k, v in metadata.items()}


def gguf_config(path: str, meta: dict[str, Any]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            path, f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(path, f"metadata key {arch}.{name} is missing")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    n_layers = int(key("block_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    try:
        return ModelConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            intermediate_size=int(key("feed_forward_length")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings=True,  # corrected by load_gguf once it knows whether output.weight exists
            layers=layer_specs(n_layers, meta.get(f"{arch}.attention.sliding_window")),
            context_length=int(key("context_length", 2048)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
            rope_traditional=True,
            architecture=arch,
        )
    except ValueError as exc:
        raise ModelLoadError(path, f"bad hyper-parameters: {exc}") from None


def gguf_tensors(
    path: str, raw: dict[str, mx.array], config: ModelConfig
) -> dict[str, mx.array | QuantTensor]:
    """Canonical names (see transformer.py) from GGUF names; a missing tensor is a ModelLoadError."""

    def get(name: str, optional: bool = False) -> mx.array | QuantTensor | None:
        return named_tensor(path, raw, name, 32, optional)

    out: dict[str, mx.array | QuantTensor] = {"embed": get("token_embd"), "norm": get("output_norm")}
    head = get("output", optional=True)
    if head is not None:
        out["lm_head"] = head
    for i in range(config.num_layers):
        for gguf_name, name in _LAYER_NAMES.items():
            out[f"layers.{i}.{name}"] = get(f"blk.{i}.{gguf_name}")
    _check_shapes(path, out, config)
    return out


def _check_shapes(path: str, tensors: dict[str, mx.array | QuantTensor], c: ModelConfig) -> None:
    want = {
        "embed": (c.vocab_size, c.hidden_size),
        "norm": (c.hidden_size,),
        "lm_head": (c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_layers):
        p = f"layers.{i}."
        want.update(
            {
                p + "attn_norm": (c.hidden_size,),
                p + "mlp_norm": (c.hidden_size,),
                p + "q": (c.q_size, c.hidden_size),
                p + "k": (c.kv_size, c.hidden_size),
                p + "v": (c.kv_size, c.hidden_size),
                p + "o": (c.hidden_size, c.q_size),
                p + "gate": (c.intermediate_size, c.hidden_size),
                p + "up": (c.intermediate_size, c.hidden_size),
                p + "down": (c.hidden_size, c.intermediate_size),
            }
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != want[name]:
            raise ModelLoadError(
                path, f"tensor {name} has shape {tuple(tensor.shape)}, expected {want[name]}"
            )


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, mx.array | QuantTensor], dict[str, Any]]:
    """(config, canonical tensors, metadata) of a llama-architecture GGUF file."""
    raw, meta = read_gguf(path)
    config = gguf_config(path, meta)
    if "output.weight" in raw:
        config = replace(config, tie_embeddings=False)
    return config, gguf_tensors(path, raw, config), meta
