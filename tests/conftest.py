"""Shared fixtures: tiny seeded random models (hidden 64, vocab 128, 4 heads, 2 KV heads); tier markers."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from engine_service.model.random_init import random_model

_TESTS = Path(__file__).resolve().parent
# A test's tier follows the room it lives in: everything under these folders is marked ``unit``
# (in-process, no servers, no real model; the whole tier runs in well under a minute on 2 cores).
_UNIT_ROOMS = (_TESTS / "unit", _TESTS / "kernels")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.path.is_relative_to(room) for room in _UNIT_ROOMS):
            item.add_marker(pytest.mark.unit)


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
