"""Tiny seeded random models for tests and benches: ``random_model("FRFR", window=4, seed=0)`` (hidden 64,
vocab 128, 4 query and 2 KV heads; F full, R/S sliding), the same weights for a seed everywhere."""

from __future__ import annotations

import mlx.core as mx

from engine_service.model.arch import architecture
from engine_service.model.config import ModelConfig, parse_layer_pattern
from engine_service.model.transformer import Transformer


def tiny_config(
    layers: str = "FRFR",
    window: int = 4,
    *,
    hidden: int = 64,
    vocab: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    rope_traditional: bool = False,
    tie_embeddings: bool = True,
    architecture: str = "llama",
    head_dim: int | None = None,
    rope_local_theta: float | None = None,
    attn_scale: float | None = None,
) -> ModelConfig:
    """A tiny config of ``architecture`` (any registered one; the pattern says which layers slide)."""
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=len(layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        intermediate_size=intermediate,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_embeddings=tie_embeddings,
        layers=parse_layer_pattern(layers, window),
        context_length=4096,
        bos_token_id=1,
        eos_token_ids=(2,),
        rope_traditional=rope_traditional,
        architecture=architecture,
        rope_local_theta=rope_local_theta,
        attn_scale=attn_scale,
    )


def random_tensors(config: ModelConfig, seed: int = 0) -> dict[str, mx.array]:
    """Canonical float32 tensors of the config's architecture, scaled so activations stay O(1) and
    attention is far from uniform."""
    arch = architecture(config.architecture)
    shapes = arch.shapes(config)
    key = mx.random.key(seed)
    keys = iter(mx.random.split(key, 16 + 16 * config.num_layers))

    def make(name: str) -> mx.array:
        shape = shapes[name]
        if len(shape) == 1:
            noise = mx.random.normal(shape, key=next(keys))
            return 0.1 * noise if name.endswith("_bias") else 1.0 + 0.1 * noise
        gain = 2.0 if name.rsplit(".", 1)[-1] in ("q", "k") else 1.0
        return mx.random.normal(shape, key=next(keys)) * (gain / shape[1] ** 0.5)

    tensors: dict[str, mx.array] = {
        "embed": mx.random.normal((config.vocab_size, config.hidden_size), key=next(keys)),
        "norm": make("norm"),
    }
    for i in range(config.num_layers):
        for name in arch.layer_tensors:
            tensors[f"layers.{i}.{name}"] = make(f"layers.{i}.{name}")
    if not config.tie_embeddings:
        tensors["lm_head"] = make("lm_head")
    mx.eval(tensors)
    return tensors


def random_model(
    layers: str = "FRFR", window: int = 4, seed: int = 0, *, weights_dtype: str = "float32", **config_kwargs
) -> Transformer:
    """A seeded tiny Transformer; ``config_kwargs`` go to :func:`tiny_config`."""
    config = tiny_config(layers, window, **config_kwargs)
    model = Transformer(config, random_tensors(config, seed), weights_dtype)
    mx.eval(model.parameters())
    return model
