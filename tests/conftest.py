"""Shared fixtures: tiny seeded random models (hidden 64, vocab 128, 4 heads, 2 KV heads)."""

from __future__ import annotations

import pytest

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from engine_service.model.random_init import random_model


@pytest.fixture
def tiny_model():
    """Factory: ``tiny_model(layers="FRFR", window=4, seed=0, **kw)`` -> Transformer.

    ``F`` = full-history layer, ``R``/``S`` = sliding window of ``window`` positions. Extra keywords go
    to :func:`engine_service.model.random_init.random_model` (``weights_dtype``, ``rope_traditional``,
    ``tie_embeddings``, ...). Outside pytest call ``random_model`` directly.
    """

    def make(layers: str = "FRFR", window: int = 4, seed: int = 0, **kwargs):
        return random_model(layers, window, seed, **kwargs)

    return make
