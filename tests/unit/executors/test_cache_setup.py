"""One cache geometry for a model: the executor and the greedy loop build their caches the same way
(the vocabulary check they share: tests/unit/api/test_limits.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine_service.api.errors import InvalidArgument
from engine_service.executors.cache_setup import build_session_cache, cache_config
from engine_service.executors.module import ModuleExecutor
from engine_service.greedy import new_cache


@pytest.mark.parametrize("kind", ["batched-sequence", "batched-cell"])
def test_greedy_and_the_executor_share_the_cache_geometry(tiny_model, kind) -> None:
    model = tiny_model("FSFS", window=4)
    ex = ModuleExecutor.create(
        model, kind, max_sessions=1, max_session_tokens=96, prefill_chunk=16, kv_dtype="float32"
    )
    greedy = new_cache(model, 96, kind=kind, prefill_chunk=16, kv_dtype="float32")
    assert greedy.config == ex.cache.config
    cfg = ex.cache.config
    assert cfg.layers == tuple(model.config.layers) and cfg.max_write == 16 and cfg.capacity == 96


def test_cache_config_carries_the_model_geometry_and_kv_dtype(tiny_model) -> None:
    model = tiny_model("FRFR", window=5)
    cfg = cache_config(model.config, max_sessions=3, max_session_tokens=40, kv_dtype=mx.float16, max_write=8)
    assert (cfg.capacity, cfg.max_seqs, cfg.max_write, cfg.dtype) == (120, 3, 8, mx.float16)
    assert (cfg.kv_heads, cfg.head_dim) == (model.config.num_kv_heads, model.config.head_dim)
    assert cfg.initial_capacity == 40  # preallocation never exceeds one session


def test_limits_and_backends_name_what_is_wrong(tiny_model) -> None:
    config = tiny_model("FRFR", window=4).config
    with pytest.raises(InvalidArgument, match="max_write"):
        cache_config(config, max_sessions=1, max_session_tokens=8, max_write=0)
    fits = cache_config(config, max_sessions=65, max_session_tokens=8)
    with pytest.raises(InvalidArgument, match="cache_kind"):
        build_session_cache("nope", fits)
    # batched-cell counts each cell's holders: no 64-sequence limit any more
    assert build_session_cache("batched-cell", fits).max_seqs == 65
