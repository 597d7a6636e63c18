"""Every registered architecture against the naive float64 forward (tests/model/naive_reference.py),
on tiny seeded models with sliding layers; the registry's lookups and refusals; negative controls that
show each architecture-specific piece is visible in the logits."""

from __future__ import annotations

import numpy as np
import pytest

from engine_service.api.errors import ModelLoadError
from engine_service.model import arch as registry
from engine_service.model.random_init import random_tensors, tiny_config
from engine_service.model.transformer import Transformer
from tests.model import naive_reference
from tests.model.test_transformer import TOKENS, close, cold

# (architecture, extra tiny_config keywords): Gemma 3 with head_dim != hidden / heads, its own local
# RoPE base and score scale, as the real model has
ARCHS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 24},
    "phi3": {},
    "gemma3": {"head_dim": 32, "rope_local_theta": 10.0, "attn_scale": 0.3},
}


def tiny(arch: str, layers: str = "RFRF", **kw):
    config = tiny_config(layers, 3, architecture=arch, **{**ARCHS[arch], **kw})
    return config, random_tensors(config, seed=7)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("tied", [True, False])
def test_each_architecture_matches_the_naive_forward(arch, tied):
    config, tensors = tiny(arch, tie_embeddings=tied)
    got = cold(Transformer(config, tensors), TOKENS)
    want = naive_reference.forward(config, tensors, TOKENS)
    assert close(got, want), np.abs(np.asarray(got) - want).max()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_gemma3_on_block_weights_equals_its_float_model(fmt):
    """The kernels' formats run the same math: the float model of the blocks' values agrees."""
    config, tensors = tiny("gemma3")
    quant = Transformer(config, tensors, fmt)
    from engine_service.model.formats.block_quant import to_block_format

    values = {
        k: (
            to_block_format(v, "q8_0" if k == "embed" or fmt == "q8_0" else fmt).dequantize()
            if v.ndim == 2
            else v
        )
        for k, v in tensors.items()
    }
    assert close(cold(quant, TOKENS), cold(Transformer(config, values), TOKENS), atol=1e-4)


def _without(tensors: dict, part: str) -> dict:
    """Gemma's tensors with one piece neutralised (norm weights to 1), for the negative controls."""
    out = dict(tensors)
    for k in out:
        if k.endswith("." + part):
            out[k] = out[k] * 0 + 1
    return out


@pytest.mark.parametrize("part", ["q_norm", "post_attn_norm", "post_mlp_norm"])
def test_gemma3_pieces_are_visible(part):
    """Negative controls: the reference notices a missing QK-norm or sandwich norm (so the comparison
    above could fail), and the engine agrees with the reference on the altered model too."""
    config, tensors = tiny("gemma3")
    want = naive_reference.forward(config, tensors, TOKENS)
    altered = _without(tensors, part)
    got = cold(Transformer(config, altered), TOKENS)
    assert not close(got, want)
    assert close(got, naive_reference.forward(config, altered, TOKENS))


def test_gemma3_local_rope_base_and_scale_are_visible():
    config, tensors = tiny("gemma3")
    want = naive_reference.forward(config, tensors, TOKENS)
    for change in ({"rope_local_theta": None}, {"attn_scale": None}):
        other = tiny_config("RFRF", 3, architecture="gemma3", **{**ARCHS["gemma3"], **change})
        assert not close(cold(Transformer(other, tensors), TOKENS), want)


def test_gemma3_layer_pattern_every_sixth_global():
    specs = registry.architecture("gemma3").layer_pattern(18, 512, {}, "x")
    assert [i for i, s in enumerate(specs) if not s.sliding] == [5, 11, 17]
    assert all(s.window == 512 for s in specs if s.sliding)


def test_registry_lookups_and_refusals():
    assert registry.for_gguf("llama", "f").name == "llama"
    assert registry.for_gguf("gemma3", "f").name == "gemma3"
    assert registry.for_model_type("mistral", "f").name == "llama"
    assert registry.for_model_type("gemma3_text", "f").name == "gemma3"
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'mamba'.*gemma3.*llama.*phi3.*qwen2"):
        registry.for_gguf("mamba", "f")
    with pytest.raises(ModelLoadError, match="unsupported model_type"):
        registry.for_model_type(None, "f")
    with pytest.raises(ValueError, match="unknown architecture"):
        registry.architecture("gpt9")
    # every registered architecture names a shape for each tensor it reads
    for arch in registry.BY_NAME.values():
        config = tiny_config("FR", 3, architecture=arch.name)
        names = arch.tensor_names(config, "gguf")
        assert set(names) <= set(arch.shapes(config))
