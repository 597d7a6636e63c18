"""The shape of what a packed step hands the model: views, masks, and where rows go.

Expected values are hand-computed from the protocol (batch_control.py), not read from the cache.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine_service.cache.batch_control import Segment
from engine_service.cache.registry import build_cache
from tests.unit.cache.harness import TOL, Driver, geometry


def rows(t: int) -> mx.array:
    return mx.array(np.random.default_rng(t).standard_normal((t, 2, 8)).astype(np.float32))


def test_sequence_views_are_per_segment_slices_with_cheap_masks() -> None:
    cache = build_cache("batched-sequence", geometry(3, initial=8))
    a, b = cache.seq_new(), cache.seq_new()
    step = cache.begin_step([Segment(a, 0, 3), Segment(b, 0, 1)])
    assert cache.pos(a) == 3 and cache.pos(b) == 1  # begin_step advances positions
    flat = step.views(0, rows(4), rows(4))
    assert [v.rows for v in flat] == [slice(0, 3), slice(3, 4)]
    assert [v.mask for v in flat] == ["causal", None]  # prefill causal, single row: no mask
    assert flat[0].keys.shape == (2, 3, 8) and flat[1].keys.shape == (2, 1, 8)
    sliding = step.views(1, rows(4), rows(4))
    # the sliding layer is laid out flat until it wraps: window 4 hides nothing at positions 0..2
    assert [v.mask for v in sliding] == ["causal", None] and sliding[0].keys.shape == (2, 3, 8)
    mx.eval(step.state())
    np.testing.assert_array_equal(np.array(flat[0].keys), np.array(rows(4)[:3]).transpose(1, 0, 2))
    # positions 3..5 (6 <= 7 slots: still flat): each query reads the 4 positions ending at its own
    step = cache.begin_step([Segment(a, 3, 3)])
    (view,) = step.views(1, rows(3), rows(3))
    assert view.keys.shape == (2, 6, 8) and view.positions.tolist() == list(range(6))
    assert np.array(view.mask).astype(int).tolist() == [
        [1, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 1],
    ]


def test_sequence_ring_wraps_and_masks_by_position() -> None:
    cache = build_cache("batched-sequence", geometry(3))  # 4 + 3 - 1 + 1 spare = 7 slots
    s = cache.seq_new()
    for start in (0, 3, 6):
        mx.eval(cache.begin_step([Segment(s, start, 3)]).views(1, rows(3), rows(3))[0].keys)
    step = cache.begin_step([Segment(s, 9, 2)])  # positions 9, 10 -> slots 2, 3
    (view,) = step.views(1, rows(2), rows(2))
    # slots 0..6 hold positions 7, 8, 9, 10, 4, 5, 6; window 4: q=9 sees 6..9, q=10 sees 7..10
    assert view.keys.shape == (2, 7, 8)
    assert np.array(view.mask).astype(int).tolist() == [[1, 1, 1, 0, 0, 0, 1], [1, 1, 1, 1, 0, 0, 0]]


def test_cell_views_of_contiguous_sequences_are_slices_with_causal_masks() -> None:
    cache = build_cache("batched-cell", geometry(3, capacity=64, max_seqs=4))
    a, b = cache.seq_new(), cache.seq_new()
    step = cache.begin_step([Segment(a, 0, 3), Segment(b, 0, 2)])
    assert cache.cells(a).tolist() == [0, 1, 2] and cache.cells(b).tolist() == [16, 17]  # regions of 16
    flat = step.views(0, rows(5), rows(5))
    assert [v.mask for v in flat] == ["causal", "causal"]
    assert [v.rows for v in flat] == [slice(0, 3), slice(3, 5)]
    mx.eval(step.state())
    step = cache.begin_step([Segment(a, 3, 1), Segment(b, 2, 1)])
    flat = step.views(0, rows(2), rows(2))
    assert [v.mask for v in flat] == [None, None] and cache.cells(a).tolist() == [0, 1, 2, 3]
    assert flat[1].keys.shape == (2, 3, 8)
    (ring_a, _) = step.views(1, rows(2), rows(2))
    assert np.array(ring_a.mask).tolist() == [[True, True, True, True]]


def test_cell_clone_reads_shared_cells_through_a_gather() -> None:
    d = Driver("batched-cell", geometry(3, capacity=64, max_seqs=4))
    src = d.new()
    d.fill(src, 5)
    clone = d.clone(src, 3)
    assert d.step({clone: 2}) < TOL
    cells = d.cache.cells(clone)
    assert cells[:3].tolist() == [0, 1, 2] and cells[3] >= 16  # own rows in the clone's region
    positions, holders = d.cache.cell_info(cells)
    assert positions.tolist() == [0, 1, 2, 3, 4]
    assert holders.tolist() == [2, 2, 2, 1, 1]  # the shared prefix has two holders, the clone's rows one
    assert d.step({clone: 1, src: 2}) < TOL
