"""Per-layer attention patterns from config keys, and ModelConfig validation."""

from __future__ import annotations

import pytest

from engine_service.cache.config import FULL, SLIDING, LayerSpec
from engine_service.model.config import ModelConfig, layer_specs, parse_layer_pattern
from engine_service.model.random_init import tiny_config

F, S = LayerSpec(FULL), LayerSpec(SLIDING, 8)


@pytest.mark.parametrize(
    "kwargs,want",
    [
        ({}, (F, F, F, F)),
        ({"sliding_window": 8}, (S, S, S, S)),  # Mistral: every layer slides
        ({"sliding_window": 8, "sliding_window_pattern": 2}, (S, F, S, F)),  # Gemma: every 2nd layer full
        ({"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"] * 2}, (F, S, F, S)),
        ({"sliding_window": None, "sliding_window_pattern": 2}, (F, F, F, F)),
    ],
)
def test_layer_specs(kwargs, want):
    assert layer_specs(4, **kwargs) == want


def test_layer_spec_errors():
    with pytest.raises(ValueError, match="4 layers"):
        layer_specs(4, 8, ["full_attention"])
    with pytest.raises(ValueError, match="unsupported attention kind"):
        layer_specs(1, 8, ["chunked_attention"])
    with pytest.raises(ValueError, match="sliding_window is not set"):
        layer_specs(1, None, ["sliding_attention"])
    with pytest.raises(ValueError, match="F \\(full\\)"):
        parse_layer_pattern("FX", 4)


def test_pattern():
    assert parse_layer_pattern("FRS", 3) == (LayerSpec(FULL), LayerSpec(SLIDING, 3), LayerSpec(SLIDING, 3))


@pytest.mark.parametrize(
    "change,field",
    [
        ({"num_kv_heads": 3}, "num_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"layers": ()}, "layers"),
        ({"head_dim": 15}, "head_dim"),
        ({"eos_token_ids": (500,)}, "special token"),
        ({"rope_theta": 0.0}, "rope_theta"),
    ],
)
def test_model_config_validation(change, field):
    base = tiny_config("FR", 4).__dict__ | change
    with pytest.raises(ValueError, match=field):
        ModelConfig(**base)
