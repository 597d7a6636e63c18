"""Bad input is a refusal (None/False) or a typed error, never a corrupted cache.

After every refusal or error the source must read exactly as before (same probe, same outputs).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.api.errors import CacheError, InvalidArgument, NotFound
from engine_service.cache.batch_control import BatchControl, KVStep, Segment
from engine_service.cache.config import CacheConfig, LayerSpec
from engine_service.cache.registry import build_cache, cache_kinds
from tests.unit.cache.harness import TOL, Driver, geometry

KINDS = ["batched-sequence", "batched-cell"]


def test_registry_lists_kinds_and_rejects_unknown_names() -> None:
    assert set(cache_kinds()) == {"batched-sequence", "batched-cell"}
    for kind in cache_kinds():
        cache = build_cache(kind, geometry(1))
        assert isinstance(cache, BatchControl)
        sid = cache.seq_new()
        assert isinstance(cache.begin_step([Segment(sid, 0, 1)]), KVStep)
    with pytest.raises(InvalidArgument, match="batched-sequence, batched-cell"):
        build_cache("paged", geometry(1))
    with pytest.raises(InvalidArgument):
        build_cache("batched-cell", {"capacity": 4})


def test_cell_cache_validates_max_seqs() -> None:
    with pytest.raises(InvalidArgument, match="max_seqs"):
        build_cache("batched-cell", geometry(1, max_seqs=0))
    # no owner-bit limit: a cell counts its holders
    assert build_cache("batched-cell", geometry(1, max_seqs=1000)).max_seqs == 1000


@pytest.fixture(params=KINDS)
def loaded(request: pytest.FixtureRequest) -> tuple[Driver, int, np.ndarray]:
    """A driver with one 9-row sequence (max_write 3) and its probe outputs."""
    d = Driver(request.param, geometry(3, capacity=64, max_seqs=4))
    src = d.new()
    d.fill(src, 9)
    assert d.probe(src) < TOL
    return d, src, d.last.copy()


def unchanged(d: Driver, src: int, before: np.ndarray, pos: int = 9) -> None:
    assert d.cache.pos(src) == pos
    assert d.probe(src) < TOL
    np.testing.assert_array_equal(d.last, before)


def test_unknown_sequence_ids(loaded) -> None:
    d, src, before = loaded
    cache = d.cache
    for bad in (src + 1, -1, 99, None, "0", True):
        for call in (
            lambda b=bad: cache.pos(b),
            lambda b=bad: cache.rewind(b, 0),
            lambda b=bad: cache.seq_clone(b, 0),
            lambda b=bad: cache.seq_rm(b),
            lambda b=bad: cache.can_admit(b, 1),
        ):
            with pytest.raises(NotFound):
                call()
    with pytest.raises(NotFound):
        cache.begin_step([Segment(src, 9, 1), Segment(3, 0, 1)])
    unchanged(d, src, before)


def test_bad_positions(loaded) -> None:
    d, src, before = loaded
    cache = d.cache
    with pytest.raises(CacheError):
        cache.rewind(src, -1)
    with pytest.raises(CacheError):
        cache.seq_clone(src, -2)
    assert cache.rewind(src, 10) is False  # past the length: a refusal
    assert cache.seq_clone(src, 10) is None
    with pytest.raises(CacheError):
        cache.begin_step([Segment(src, 8, 1)])  # a position the sequence already holds
    with pytest.raises(CacheError):
        cache.begin_step([Segment(src, 10, 1)])  # a gap
    with pytest.raises(CacheError):
        cache.begin_step([Segment(src, 9, 1), Segment(src, 10, 1)])  # twice in one step
    with pytest.raises(CacheError):
        cache.begin_step([])
    with pytest.raises(ValueError):
        Segment(src, -1, 1)
    unchanged(d, src, before)


def test_clone_of_empty_source(loaded) -> None:
    d, src, before = loaded
    empty = d.new()
    assert d.clone(empty, 1) is None
    child = d.clone(empty, 0)
    assert child is not None and d.cache.pos(child) == 0
    assert d.fill(child, 2) < TOL
    assert d.cache.pos(empty) == 0
    unchanged(d, src, before)


def test_no_free_sequence_slot(loaded) -> None:
    d, src, before = loaded
    extra = [d.new() for _ in range(3)]  # max_seqs 4: now full
    assert None not in extra
    assert d.cache.seq_new() is None
    assert d.cache.seq_clone(src, 4) is None
    d.rm(extra[0])
    unchanged(d, src, before)


def test_capacity_exhausted(loaded) -> None:
    d, src, before = loaded
    other = d.new()
    while d.cache.can_admit(other, 1):
        d.step({other: 1})
    assert d.cache.used() == 64
    with pytest.raises(CacheError):
        d.cache.begin_step([Segment(other, d.cache.pos(other), 1)])
    if d.kind == "batched-sequence":
        assert d.cache.seq_clone(src, 1) is None  # a copy needs room
    d.rm(other)
    unchanged(d, src, before)


def test_step_longer_than_max_write_on_a_ring_is_refused(loaded) -> None:
    d, src, before = loaded
    if d.kind == "batched-sequence":
        assert not d.cache.can_admit(src, 4)
        with pytest.raises(CacheError):
            d.cache.begin_step([Segment(src, 9, 4)])
    else:  # cells never evict: a long step is fine
        assert d.cache.can_admit(src, 4)
    assert not d.cache.can_admit(src, 0)
    unchanged(d, src, before)


def test_views_reject_bad_shapes_and_layers() -> None:
    for kind in KINDS:
        cache = build_cache(kind, geometry(3))
        sid = cache.seq_new()
        step = cache.begin_step([Segment(sid, 0, 2)])
        good = mx.zeros((2, 2, 8))
        with pytest.raises(CacheError):
            step.views(0, mx.zeros((3, 2, 8)), mx.zeros((3, 2, 8)))
        with pytest.raises(CacheError):
            step.views(2, good, good)
        assert len(step.views(0, good, good)) == 1


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_write"):
        CacheConfig(capacity=8, max_seqs=2, layers=(LayerSpec(),), kv_heads=1, head_dim=4, max_write=0)
    with pytest.raises(ValueError, match="window"):
        LayerSpec("sliding", None)


def test_clear_drops_everything() -> None:
    for kind in KINDS:
        d = Driver(kind, geometry(2, max_seqs=2))
        a = d.new()
        d.fill(a, 5)
        d.clone(a, 3)
        d.cache.clear()
        assert d.cache.used() == 0
        with pytest.raises(NotFound):
            d.cache.pos(a)
        assert d.cache.seq_new() == 0 and d.cache.seq_new() == 1
