"""Seed behaviours "Caches against cold attention", on both kinds where they apply.

Geometry: layer 0 flat, layer 1 ring/sliding with window 4; every read is compared with naive fp32
attention over the sequence's true history (harness.naive_attention), tolerance 1e-5.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.cache import config as cache_config
from engine_service.cache.batch_control import Segment
from tests.unit.cache.harness import TOL, Driver, geometry

KINDS = ["batched-sequence", "batched-cell"]
MAX_WRITES = [1, 3, 5]


def stale(d: Driver) -> int:
    return d.cache.stale_reads() if d.kind == "batched-sequence" else 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_write", MAX_WRITES)
def test_wrapped_snapshot_survives_source_and_branch_writes(kind: str, max_write: int) -> None:
    d = Driver(kind, geometry(max_write))
    src = d.new()
    assert d.fill(src, 21) < TOL
    snap = d.clone(src, 21)
    assert d.fill(src, 9) < TOL  # the source wraps its ring again
    branch = d.clone(snap, 21)
    assert d.fill(branch, 7) < TOL
    assert d.probe(snap) < TOL
    assert d.probe(src) < TOL and d.probe(branch) < TOL
    assert stale(d) == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_write", MAX_WRITES)
def test_clone_below_the_ring_floor(kind: str, max_write: int) -> None:
    d = Driver(kind, geometry(max_write))
    src = d.new()
    d.fill(src, 21)
    floor = 21 - max_write
    at_floor = d.clone(src, floor)
    assert at_floor is not None
    assert d.probe(at_floor) < TOL
    below = d.clone(src, floor - 1)
    if kind == "batched-sequence":
        assert below is None  # the ring no longer holds the window it would need
    else:  # cells never evict: any committed prefix can be cloned
        assert below is not None and d.probe(below) < TOL
    assert d.probe(src) < TOL and stale(d) == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_write", MAX_WRITES)
def test_older_snapshot_keeps_a_branch_window_the_newer_lost(kind: str, max_write: int) -> None:
    d = Driver(kind, geometry(max_write))
    src = d.new()
    d.fill(src, 12)
    old = d.clone(src, 12)
    d.fill(src, 9)
    new = d.clone(src, 21)
    at = 12 - max_write  # the older snapshot's floor
    from_new = d.clone(new, at)
    if kind == "batched-sequence":
        assert from_new is None
    else:
        assert from_new is not None and d.probe(from_new) < TOL
    from_old = d.clone(old, at)
    assert from_old is not None
    assert d.fill(from_old, 6) < TOL  # the branch diverges from the source's history at `at`
    assert d.probe(from_old) < TOL and stale(d) == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_write", MAX_WRITES)
def test_matching_window_does_not_replace_earlier_history(kind: str, max_write: int) -> None:
    d = Driver(kind, geometry(max_write))
    rng = np.random.default_rng(7)
    shape = (6, 2, 2, 2, 8)  # [rows, layers, k/v, heads, dim]
    tail = rng.standard_normal(shape).astype(np.float32)  # last 6 rows shared (longer than the window)
    a, b = d.new(), d.new()
    for seq in (a, b):
        d.fill(seq, 5)  # different early history
        for i in range(6):
            d.step({seq: 1}, tail[i : i + 1])
    assert d.probe(a) < TOL
    out_a = d.last.copy()
    assert d.probe(b) < TOL
    out_b = d.last.copy()
    np.testing.assert_allclose(out_a[:, 1], out_b[:, 1], atol=TOL)  # same window: same ring output
    assert np.abs(out_a[:, 0] - out_b[:, 0]).max() > 1e-3  # the flat layer still sees its own history


@pytest.mark.parametrize("max_write", MAX_WRITES)
def test_overwritten_rewind_is_refused_and_forcing_it_reads_stale_rows(max_write: int) -> None:
    d = Driver("batched-sequence", geometry(max_write))
    src = d.new()
    d.fill(src, 21)
    target = 21 - max_write - 3
    assert d.cache.rewind(src, target) is False
    assert d.cache.pos(src) == 21 and d.probe(src) < TOL  # refusal changed nothing

    # The deliberately unsafe control: replay the refused rewind with the check bypassed.
    d.cache.sequence(src)._force_rewind(target)
    del d.history[src][target:]
    err = d.step({src: 1})
    assert d.cache.stale_reads() > 0, "bypassing can_rewind must read rows the ring overwrote"
    assert err > 1e-3, "stale rows must change the attention output (else the check is untested)"


@pytest.mark.parametrize("max_write", MAX_WRITES)
def test_rewind_at_the_floor_is_exact(max_write: int) -> None:
    d = Driver("batched-sequence", geometry(max_write))
    src = d.new()
    d.fill(src, 21)
    assert d.rewind(src, 21 - max_write)
    assert d.fill(src, 2 * max_write + 3) < TOL
    assert d.cache.stale_reads() == 0


def test_cell_part_masks_after_source_append_and_branch() -> None:
    # as the next test, but regions of 16 cells: the branch's row lands in cell 16, far enough from its
    # prefix (cells 0..3) that a slice of the span would be mostly other cells
    d = Driver("batched-cell", geometry(1, capacity=32, max_seqs=2))
    src = d.new()
    d.fill(src, 4)
    branch = d.clone(src, 4)
    d.fill(src, 2)
    step = d.cache.begin_step([Segment(branch, 4, 1)])  # cell 16: position 4 of the branch
    rows = np.zeros((1, 2, 8), dtype=np.float32)
    (flat,) = step.views(0, mx.array(rows), mx.array(rows))
    (ring,) = step.views(1, mx.array(rows), mx.array(rows))
    assert d.cache.cells(branch).tolist() == [0, 1, 2, 3, 16]
    # two runs, cells 0..3 and 16, read as two pool slices; hand-computed masks per run: the window of 4
    # at position 4 drops position 0 (cell 0), everything else is visible (None)
    for view in (flat, ring):
        assert view.keys is None and [p.keys.shape[1] for p in view.parts] == [4, 1]
    assert [p.mask for p in flat.parts] == [None, None]
    assert np.array(ring.parts[0].mask).astype(int).tolist() == [[0, 1, 1, 1]]
    assert ring.parts[1].mask is None


def test_cell_masks_after_source_append_and_branch() -> None:
    # 7 cells, 2 regions of 3: the source runs 0..5, the branch's own region is full so its row lands
    # in cell 6, giving the seed's layout (view = pool cells 0..6: the owned cells fill half the span)
    d = Driver("batched-cell", geometry(1, capacity=7, max_seqs=2))
    src = d.new()
    d.fill(src, 4)  # cells 0..3, positions 0..3
    branch = d.clone(src, 4)
    d.fill(src, 2)  # cells 4, 5: positions 4, 5 of the source only
    step = d.cache.begin_step([Segment(branch, 4, 1)])  # cell 6: position 4 of the branch
    rows = np.zeros((1, 2, 8), dtype=np.float32)
    (flat,) = step.views(0, mx.array(rows), mx.array(rows))
    (ring,) = step.views(1, mx.array(rows), mx.array(rows))
    assert d.cache.cells(branch).tolist() == [0, 1, 2, 3, 6]
    # hand-computed: the branch owns cells 0..3 and 6; the window of 4 at position 4 drops position 0
    assert np.array(flat.mask).astype(int).tolist() == [[1, 1, 1, 1, 0, 0, 1]]
    assert np.array(ring.mask).astype(int).tolist() == [[0, 1, 1, 1, 0, 0, 1]]


def test_cells_freed_only_when_no_owner_remains_and_id_reuse_is_harmless() -> None:
    d = Driver("batched-cell", geometry(1))
    src = d.new()
    d.fill(src, 6)
    assert d.cache.used() == 6
    clone = d.clone(src, 4)
    assert d.cache.used() == 6  # a clone uses no cells
    d.rm(src)
    assert d.cache.used() == 4  # positions 4, 5 had one owner; 0..3 are still the clone's
    reused = d.new()
    assert reused == src  # the lowest free id comes back
    d.fill(reused, 3)
    assert d.probe(clone) < TOL  # the new owner of the old id sees nothing of the clone, and vice versa
    assert d.probe(reused) < TOL
    d.rm(clone)
    assert d.cache.used() == 3
    d.rm(reused)
    assert d.cache.used() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_fork_copies_the_prefix_then_diverges(kind: str) -> None:
    d = Driver(kind, geometry(3))
    src = d.new()
    d.fill(src, 10)
    fork = d.clone(src, 10)
    assert d.step({src: 2, fork: 3}) < TOL  # packed together, different rows
    assert d.step({fork: 1, src: 1}) < TOL
    assert d.probe(src) < TOL and d.probe(fork) < TOL


def test_partial_flat_fork_shares_the_prefix_without_copying() -> None:
    d = Driver("batched-sequence", geometry(3, initial=8, ring=False))
    src = d.new()
    d.fill(src, 12)
    src_keys = d.cache.sequence(src).buffers(0)[0]
    fork = d.clone(src, 6)
    donor, forked = d.cache.sequence(src), d.cache.sequence(fork)
    # the donor's rows became one frozen piece both read; neither has a private copy of them
    assert [(p.start, p.rows) for p in donor.pieces] == [(0, 12)]
    assert [(p.start, p.rows) for p in forked.pieces] == [(0, 6)]
    assert donor.pieces[0].block is forked.pieces[0].block
    assert forked.buffers(0)[0] is None and donor.buffers(0)[0] is None
    assert d.cache.used() == 12  # the shared rows counted once
    assert d.probe(fork) < TOL and d.probe(src) < TOL
    assert d.fill(fork, 4) < TOL and d.fill(src, 3) < TOL  # both write their own tails
    assert d.probe(src) < TOL and d.probe(fork) < TOL
    # the frozen rows are the donor's original rows, never written since
    np.testing.assert_array_equal(np.array(donor.pieces[0].keys[0]), np.array(src_keys[:, :12]))
    assert d.cache.used() == 12 + 4 + 3


def test_rewinding_into_a_piece_moves_the_tail_down() -> None:
    d = Driver("batched-sequence", geometry(3, initial=8, ring=False))
    src = d.new()
    d.fill(src, 10)
    fork = d.clone(src, 10)
    assert d.rewind(src, 4)
    seq = d.cache.sequence(src)
    assert seq.tail_start == 4 and [(p.start, p.rows) for p in seq.pieces] == [(0, 4)]
    assert d.fill(src, 5) < TOL and d.probe(fork) < TOL  # the fork still reads the 10 original rows
    assert d.probe(src) < TOL


def test_many_seals_merge_the_smallest_pieces() -> None:
    d = Driver("batched-sequence", geometry(3, initial=8, ring=False))
    src = d.new()
    forks = []
    for _ in range(12):
        d.fill(src, 2)
        forks.append(d.clone(src, d.cache.pos(src)))
    assert len(d.cache.sequence(src).pieces) <= 8
    assert d.probe(src) < TOL and all(d.probe(f) < TOL for f in forks)
    assert d.fill(src, 3) < TOL


@pytest.mark.parametrize("kind", KINDS)
def test_sequences_share_one_capacity(kind: str) -> None:
    d = Driver(kind, geometry(3, capacity=20, ring=False))
    src = d.new()
    d.fill(src, 12)
    fork = d.clone(src, 12)  # a clone shares the rows: it needs no room
    assert fork is not None and d.cache.used() == 12
    assert d.cache.can_admit(fork, 3) and not d.cache.can_admit(fork, 9)
    d.rm(fork)
    assert d.cache.can_admit(src, 3) and d.cache.used() == 12
    assert d.step({src: 3}) < TOL


def test_partial_fork_of_a_wrapped_ring_and_fork_of_fork_keeps_the_floor() -> None:
    d = Driver("batched-sequence", geometry(1))
    src = d.new()
    d.fill(src, 10)
    assert d.clone(src, 6) is None
    fork = d.clone(src, 9)
    assert fork is not None and d.probe(fork) < TOL
    assert d.cache.sequence(fork).written == 10  # inherited high-water mark
    assert d.clone(fork, 8) is None  # the donor's floor (9) holds in the fork
    assert d.probe(src) < TOL


def test_ring_of_window_4_max_write_3_holds_7_slots() -> None:
    d = Driver("batched-sequence", geometry(3))
    src = d.new()
    d.fill(src, 17)
    older = d.clone(src, 17)
    d.fill(src, 4)
    assert d.cache.sequence(src).slots(1) == 7  # window + max_write - 1 + the spare slot
    assert d.cache.sequence(src).buffers(1)[0].shape[1] == 7
    ok = d.clone(src, 18)
    assert ok is not None and d.probe(ok) < TOL
    assert d.clone(src, 17) is None
    served = d.clone(older, 17)  # the older snapshot serves what the source refused
    assert served is not None and d.fill(served, 5) < TOL
    assert d.cache.stale_reads() == 0


@pytest.mark.parametrize("spare", [1, 0])
def test_a_one_row_step_taken_back_leaves_every_clone_from_the_floor_exact(monkeypatch, spare: int) -> None:
    """The decode lookahead on rings: a discarded one-row step is taken back, and every position from
    the rewind floor on still clones and continues like a cold run. Negative control: without the
    spare slot the row taken back overwrote the floor's window."""
    monkeypatch.setattr(cache_config, "RING_SPARE", spare)
    d = Driver("batched-sequence", geometry(3))  # window 4, max_write 3
    src = d.new()
    d.fill(src, 17)
    seq = d.cache.sequence(src)
    written, floor = seq.written, seq.rewind_floor
    d.step({src: 1})  # the lookahead's row at 17 ...
    seq.take_back(17, written)  # ... discarded
    del d.history[src][17:]
    assert (seq.length, seq.written, seq.rewind_floor) == (17, written, floor)
    errors = []
    for upto in range(floor, 18):
        fork = d.clone(src, upto)
        assert fork is not None
        errors.append(d.fill(fork, 3))  # a max_write step reads the window before the fork's position
        d.rm(fork)
    if spare:
        assert max(errors) < TOL
    else:
        assert errors[0] > TOL


def test_a_ring_takes_back_one_row_never_more() -> None:
    d = Driver("batched-sequence", geometry(3))
    src = d.new()
    d.fill(src, 10)
    seq = d.cache.sequence(src)
    written = seq.written
    d.step({src: 2})
    with pytest.raises(ValueError, match="cannot take back"):
        seq.take_back(10, written)
