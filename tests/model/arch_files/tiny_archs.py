"""The tiny architectures under test (Llama as the control, Qwen2, Qwen3, Phi-3, Gemma 3): their shapes,
random canonical weights in Hugging Face row order, the config their files describe (written out by
hand), and the checks on a loaded model (logits against the naive float64 forward of
tests/model/naive_reference.py, load errors)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from engine_service.api.errors import ModelLoadError
from engine_service.cache.config import FULL, SLIDING, LayerSpec
from engine_service.model import load_model
from engine_service.model.config import ModelConfig
from tests.model.reference_cache import ReferenceCache, run

TOKENS = [5, 17, 99, 3, 42, 42, 7, 120, 64, 1, 33, 8, 91, 27]  # 14 positions > the window of 4
HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 256, 4, 2, 512, 128
EPS = 1e-6
# float32 vs float64 over the same values: logits here are O(1) (max |logit| ~3), float32 rounding of
# a few 256-/512-long dot products per layer stays near 1e-6 relative
ATOL = 1e-4


@dataclass(frozen=True)
class Spec:
    """One architecture's tiny shape: ``head_dim`` None = hidden / heads; ``window``: sliding size."""

    arch: str
    layers: int = 2
    head_dim: int | None = None
    window: int | None = None
    theta: float = 10000.0
    tied: bool = True
    hf_type: str = ""

    @property
    def d(self) -> int:
        return self.head_dim or HIDDEN // HEADS


SPECS = {
    "llama": Spec("llama", tied=False, hf_type="llama"),
    "qwen2": Spec("qwen2", theta=1e6, hf_type="qwen2"),
    "qwen3": Spec("qwen3", head_dim=48, theta=1e6, hf_type="qwen3"),
    "phi3": Spec("phi3", window=4, tied=False, hf_type="phi3"),
    "gemma3": Spec("gemma3", layers=6, head_dim=96, window=4, theta=1e6, hf_type="gemma3_text"),
}

ARCHS = sorted(SPECS)

_BASE = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down")

LAYER_TENSORS = {
    "llama": _BASE,
    "qwen2": (*_BASE, "q_bias", "k_bias", "v_bias"),
    "qwen3": (*_BASE, "q_norm", "k_norm"),
    "phi3": ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down"),
    "gemma3": (*_BASE, "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"),
}

# block type per matrix role, as in a Q4_K_M file; norms and biases stay F32
QUANT = {
    "embed": "Q8_0",
    "lm_head": "Q6_K",
    "q": "Q5_0",
    "k": "Q5_0",
    "qkv": "Q5_0",
    "v": "Q4_0",
    "o": "Q4_1",
    "gate": "Q4_K",
    "up": "Q4_K",
    "gate_up": "Q4_K",
    "down": "Q6_K",
}


def role(canon: str) -> str:
    return canon.rsplit(".", 1)[-1]


def is_norm(canon: str) -> bool:
    return canon == "norm" or canon.endswith("_norm")


def expected_config(spec: Spec, eps: float = EPS, **changes) -> ModelConfig:
    """The config the files describe, written out by hand (Hugging Face semantics: default RoPE)."""
    layers = []
    for i in range(spec.layers):
        sliding = spec.window is not None and not (spec.arch == "gemma3" and (i + 1) % 6 == 0)
        layers.append(LayerSpec(SLIDING, spec.window) if sliding else LayerSpec(FULL))
    gemma = spec.arch == "gemma3"
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=spec.layers,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=spec.d,
        intermediate_size=INTER,
        rope_theta=spec.theta,
        rms_norm_eps=eps,
        tie_embeddings=spec.tied,
        layers=tuple(layers),
        context_length=4096,
        bos_token_id=1,
        eos_token_ids=(2,),
        rope_traditional=False,
        architecture=spec.arch,
        rope_local_theta=10000.0 if gemma else None,
        attn_scale=spec.d**-0.5 if gemma else None,
    )
    fields.update(changes)
    return ModelConfig(**fields)


def shapes(spec: Spec) -> dict[str, tuple[int, ...]]:
    q, kv = HEADS * spec.d, KV_HEADS * spec.d
    per_layer = {
        "attn_norm": (HIDDEN,), "mlp_norm": (HIDDEN,), "post_attn_norm": (HIDDEN,), "post_mlp_norm": (HIDDEN,),
        "q": (q, HIDDEN), "k": (kv, HIDDEN), "v": (kv, HIDDEN), "qkv": (q + 2 * kv, HIDDEN),
        "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "q_norm": (spec.d,), "k_norm": (spec.d,),
        "o": (HIDDEN, q), "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
        "down": (HIDDEN, INTER),
    }  # fmt: skip
    out = {"embed": (VOCAB, HIDDEN), "norm": (HIDDEN,)}
    if not spec.tied:
        out["lm_head"] = (VOCAB, HIDDEN)
    for i in range(spec.layers):
        for canon in LAYER_TENSORS[spec.arch]:
            out[f"layers.{i}.{canon}"] = per_layer[canon]
    return out


def random_model(spec: Spec, seed: int = 3) -> dict[str, np.ndarray]:
    """Canonical float32 tensors in Hugging Face row order. Norms are the multipliers the math uses
    (1 + 0.1 N(0, 1); for Gemma that is 1 + w), biases 0.1 N(0, 1), matrices N(0, 1) / sqrt(in) (q, k
    and their fused rows twice that, so attention is far from uniform)."""
    rng = np.random.default_rng(seed)
    out = {}
    for canon, shape in shapes(spec).items():
        r = role(canon)
        if len(shape) == 1:
            noise = rng.standard_normal(shape)
            value = 0.1 * noise if r.endswith("_bias") else 1.0 + 0.1 * noise
        else:
            gain = 2.0 if r in ("q", "k", "qkv") else 1.0
            value = rng.standard_normal(shape) * gain / np.sqrt(shape[1])
        out[canon] = value.astype(np.float32)
    return out


def logits(model, tokens=TOKENS) -> np.ndarray:
    cache = ReferenceCache(model.config.layers)
    return np.asarray(run(model, cache, [(cache.seq_new(), 0, tokens)], all_rows=True)[0], dtype=np.float64)


def gap(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def expect_error(path: str, match: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(path, "float32")
    assert info.value.path == path and "\n" not in str(info.value)
    return info.value
