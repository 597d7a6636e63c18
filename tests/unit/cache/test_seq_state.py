"""Export one sequence's K/V and import it into another cache of the same kind and geometry: the imported
sequence reads exactly what the source read (naive attention over the true history), keeps reading
correctly as it grows, and rewinds where the source could. Refusals change nothing.

Geometry: layer 0 flat, layer 1 ring/sliding with window 4 (harness.geometry).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.api.snapshot_files import StateLayout
from engine_service.cache.config import CacheConfig, LayerSpec
from engine_service.cache.seq_state import SeqState, StateTransfer, geometry_text
from tests.unit.cache.harness import TOL, Driver, geometry

KINDS = ["batched-sequence", "batched-cell"]


def transfer(src: Driver, seq: int, upto: int, dst: Driver) -> int:
    """Export ``seq`` at ``upto`` from ``src`` and import it into ``dst`` (history carried along)."""
    state = src.cache.export_seq(seq, upto)
    assert state is not None and state.length == upto
    assert dst.cache.state_problem(state) is None
    new = dst.cache.import_seq(state)
    assert new is not None and dst.cache.pos(new) == upto
    dst.history[new] = list(src.history[seq][:upto])
    return new


def test_both_kinds_transfer_state() -> None:
    for kind in KINDS:
        assert isinstance(Driver(kind, geometry(3)).cache, StateTransfer)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("max_write", "length"), [(1, 3), (3, 21), (5, 21), (5, 6)])
def test_imported_sequence_reads_like_its_source_and_keeps_growing(kind, max_write, length) -> None:
    src, dst = Driver(kind, geometry(max_write), seed=1), Driver(kind, geometry(max_write), seed=2)
    seq = src.new()
    assert src.fill(seq, length) < TOL  # 21 rows wrap the ring (4 + max_write - 1 slots) several times
    new = transfer(src, seq, length, dst)
    assert dst.probe(new) < TOL
    assert dst.fill(new, 9) < TOL  # continues: the ring keeps wrapping after the import
    assert dst.probe(new) < TOL
    assert src.probe(seq) < TOL  # the export did not change the source


@pytest.mark.parametrize("kind", KINDS)
def test_export_below_the_length_and_rewind_rules_survive(kind) -> None:
    max_write = 3
    src, dst = Driver(kind, geometry(max_write)), Driver(kind, geometry(max_write))
    seq = src.new()
    src.fill(seq, 21)
    upto = 21 - max_write  # the lowest boundary a ring still holds
    new = transfer(src, seq, upto, dst)
    assert dst.probe(new) < TOL
    if kind == "batched-sequence":
        # the high-water mark came along: the import rewinds exactly where a clone of the source could
        assert src.cache.export_seq(seq, upto - 1) is None
        for p in range(upto + 1):
            assert dst.cache.can_rewind(new, p) == src.cache.sequence(seq).copy(upto).can_rewind(p)
        assert dst.cache.stale_reads() == 0
    else:
        assert src.cache.export_seq(seq, upto - 1) is not None  # cells never evict
    assert src.cache.export_seq(seq, 22) is None  # past the length


@pytest.mark.parametrize("kind", KINDS)
def test_a_fragmented_cell_sequence_and_a_clone_export_in_position_order(kind) -> None:
    d, dst = Driver(kind, geometry(3)), Driver(kind, geometry(3))
    a, b = d.new(), d.new()
    for _ in range(4):  # interleaved steps: sequence cells end up in several runs
        d.step({a: 3, b: 2})
    child = d.clone(a, 10)
    d.fill(child, 5)
    new = transfer(d, child, 15, dst)
    assert dst.probe(new) < TOL


@pytest.mark.parametrize("kind", KINDS)
def test_negative_control_a_scrambled_state_reads_wrong(kind) -> None:
    """The comparison can fail: the same arrays with the rows of the ring layer rolled by one."""
    src, dst = Driver(kind, geometry(3)), Driver(kind, geometry(3))
    seq = src.new()
    src.fill(seq, 21)
    state = src.cache.export_seq(seq, 21)
    arrays = dict(state.arrays)
    for name in ("layers.1.keys", "layers.1.values"):
        arrays[name] = mx.roll(arrays[name], 1, axis=1)
    new = dst.cache.import_seq(SeqState(state.length, state.written, arrays))
    dst.history[new] = list(src.history[seq])
    assert dst.probe(new) > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_state_of_another_geometry_is_described_not_imported(kind) -> None:
    src = Driver(kind, geometry(3))
    seq = src.new()
    src.fill(seq, 21)
    state = src.cache.export_seq(seq, 21)
    for other in (geometry(5), geometry(3, ring=False), replace_heads(geometry(3))):
        dst = Driver(kind, other)
        problem = dst.cache.state_problem(state)
        if kind == "batched-cell" and other.kv_heads == 2:
            assert problem is None  # cells keep every row whatever the window: the arrays look the same
            assert geometry_text(other) != geometry_text(geometry(3))  # the snapshot header tells them apart
            continue
        assert problem is not None and "layers." in problem, (other, problem)
    missing = SeqState(
        state.length, state.written, {k: v for k, v in state.arrays.items() if k != "layers.0.keys"}
    )
    assert "missing ['layers.0.keys']" in Driver(kind, geometry(3)).cache.state_problem(missing)
    cast = {k: v.astype(mx.float16) for k, v in state.arrays.items()}
    assert "float16" in Driver(kind, geometry(3)).cache.state_problem(SeqState(21, state.written, cast))


def replace_heads(config: CacheConfig) -> CacheConfig:
    return CacheConfig(
        capacity=config.capacity,
        max_seqs=config.max_seqs,
        layers=config.layers,
        kv_heads=1,
        head_dim=config.head_dim,
        initial_capacity=config.initial_capacity,
        max_write=config.max_write,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_no_room_refuses_and_changes_nothing(kind) -> None:
    src = Driver(kind, geometry(3))
    seq = src.new()
    src.fill(seq, 21)
    state = src.cache.export_seq(seq, 21)
    small = Driver(kind, geometry(3, capacity=30, max_seqs=2))
    held = small.new()
    small.fill(held, 12)
    assert small.cache.import_seq(state) is None  # 21 more rows do not fit in 30
    assert small.cache.used() == 12 and small.cache.pos(held) == 12 and small.probe(held) < TOL
    full = Driver(kind, geometry(3, max_seqs=1))
    full.new()
    assert full.cache.import_seq(state) is None  # no sequence slot


def test_geometry_text_names_what_the_layout_depends_on() -> None:
    text = geometry_text(geometry(3))
    assert text == "layers=full,sliding:4;max_write=3;kv_heads=2;head_dim=8;dtype=float32"
    assert StateLayout("batched-cell", text) != StateLayout("batched-sequence", text)
    window = CacheConfig(capacity=64, max_seqs=2, layers=(LayerSpec("sliding", 6),), kv_heads=2, head_dim=8)
    assert "sliding:6" in geometry_text(window) and "max_write=512" in geometry_text(window)


def test_empty_export_round_trips() -> None:
    for kind in KINDS:
        src, dst = Driver(kind, geometry(3)), Driver(kind, geometry(3))
        seq = src.new()
        state = src.cache.export_seq(seq, 0)
        assert state is not None and all(a.shape[1] == 0 for a in state.arrays.values())
        new = dst.cache.import_seq(state)
        assert new is not None and dst.cache.pos(new) == 0
        dst.history[new] = []
        assert dst.fill(new, 7) < TOL
        assert np.isfinite(dst.last).all()
