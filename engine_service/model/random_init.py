"""Tiny seeded random models for tests and benches (no files, no downloads).

``random_model(layers="FRFR", window=4, seed=0)`` -> a :class:`Transformer` with hidden 64, vocab 128,
4 query heads and 2 KV heads; ``F`` layers attend to full history, ``R``/``S`` layers to a sliding
window of ``window`` positions. The same seed gives the same weights in every process.
"""

from __future__ import annotations

import mlx.core as mx

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
) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=len(layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=intermediate,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_embeddings=tie_embeddings,
        layers=parse_layer_pattern(layers, window),
        context_length=4096,
        bos_token_id=1,
        eos_token_ids=(2,),
        rope_traditional=rope_traditional,
    )


def random_tensors(config: ModelConfig, seed: int = 0) -> dict[str, mx.array]:
    """Canonical float32 tensors, scaled so activations stay O(1) and attention is far from uniform."""
    key = mx.random.key(seed)
    keys = iter(mx.random.split(key, 16 + 16 * config.num_layers))
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size

    def mat(out: int, inp: int, gain: float = 1.0) -> mx.array:
        return mx.random.normal((out, inp), key=next(keys)) * (gain / inp**0.5)

    def norm() -> mx.array:
        return 1.0 + 0.1 * mx.random.normal((h,), key=next(keys))

    tensors: dict[str, mx.array] = {
        "embed": mx.random.normal((config.vocab_size, h), key=next(keys)),
        "norm": norm(),
    }
    for i in range(config.num_layers):
        p = f"layers.{i}."
        tensors.update(
            {
                p + "attn_norm": norm(),
                p + "q": mat(q, h, 2.0),
                p + "k": mat(kv, h, 2.0),
                p + "v": mat(kv, h),
                p + "o": mat(h, q),
                p + "mlp_norm": norm(),
                p + "gate": mat(config.intermediate_size, h),
                p + "up": mat(inter, h),
                p + "down": mat(h, inter),
            }
        )
    if not config.tie_embeddings:
        tensors["lm_head"] = mat(config.vocab_size, h)
    mx.eval(tensors)
    return tensors


def random_model(
    layers: str = "FRFR", window: int = 4, seed: int = 0, *, weights_dtype: str = "float32", **config_kwargs
) -> Transformer:
    """A seeded tiny Transformer (see the module docstring). ``config_kwargs`` go to :func:`tiny_config`."""
    config = tiny_config(layers, window, **config_kwargs)
    model = Transformer(config, random_tensors(config, seed), weights_dtype)
    mx.eval(model.parameters())
    return model
