"""batched-cell multi-part views: a fragmented sequence (a clone's shared prefix plus its own rows) is
read as a few pool slices instead of a gather. Every read is checked against naive attention over the
sequence's true history (harness.naive_attention), never against the parts themselves."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from engine_service.cache.batch_control import KVView
from tests.unit.cache.harness import TOL, Driver, geometry, view_attention


def _runs(d: Driver, seq: int) -> int:
    cells = d.cache.cells(seq)
    return 1 + int(np.count_nonzero(np.diff(cells) != 1))


def _two_runs(max_write: int) -> tuple[Driver, int]:
    """A source of 10 rows and a clone at 6 with 3 rows of its own: runs [prefix in the source's
    region] + [its own region] (the cell after the prefix is still the source's)."""
    d = Driver("batched-cell", geometry(max_write))
    src = d.new()
    assert d.fill(src, 10) < TOL
    child = d.clone(src, 6)
    assert d.fill(child, 3) < TOL
    assert _runs(d, child) == 2
    return d, child


def _three_runs(max_write: int) -> tuple[Driver, int]:
    """A clone of the clone above, past its own rows, plus rows of its own: three runs."""
    d, child = _two_runs(max_write)
    grand = d.clone(child, 8)
    assert d.fill(grand, 2) < TOL
    assert _runs(d, grand) == 3
    return d, grand


def _assert_parts(d: Driver, n_parts: int) -> None:
    for views in d.last_views:  # flat and sliding layer
        (view,) = views
        assert view.parts is not None and len(view.parts) == n_parts


@pytest.mark.parametrize("layout,n_parts", [(_two_runs, 2), (_three_runs, 3)])
@pytest.mark.parametrize("rows", [1, 3])
def test_fragmented_reads_via_parts_equal_naive_attention(layout, n_parts, rows) -> None:
    d, seq = layout(5)
    # a decode row or a multi-row chunk; the chunk continues the last run, the parts stay the same
    assert d.step({seq: rows}) < TOL
    _assert_parts(d, n_parts)
    assert d.probe(seq) < TOL  # a full clone's row continues the last run (the cell after it is free)
    _assert_parts(d, n_parts)
    # long enough that the sliding window hides whole runs
    assert d.fill(seq, 7, chunk=rows) < TOL


def test_several_fragmented_sequences_in_one_step() -> None:
    d, child = _two_runs(4)
    other = d.clone(child, 7)
    assert d.step({child: 2, other: 1}) < TOL
    assert [len(v.parts) for v in d.last_views[0]] == [2, 3]  # other: prefix, 1 of child, own


def test_more_runs_than_max_parts_fall_back_to_the_gather() -> None:
    d, seq = _three_runs(5)
    for _ in range(3):  # each clone short of its source's end adds a run: 6 runs
        seq = d.clone(seq, d.cache.pos(seq) - 1)
        assert d.fill(seq, 2) < TOL
    assert _runs(d, seq) > 4
    assert d.step({seq: 2}) < TOL
    assert all(v.parts is None for views in d.last_views for (v,) in [views])


def _noticed(view: KVView, q: np.ndarray, good: np.ndarray) -> bool:
    """Whether the harness tells ``view`` from the correct output ``good`` (a different result, or a
    row left seeing no key at all)."""
    try:
        with np.errstate(invalid="ignore"):
            return float(np.abs(view_attention([view], q) - good).max()) > 1e-3
    except AssertionError:
        return True


def test_dropping_a_part_or_misaligning_a_mask_is_noticed() -> None:
    """Negative control: the harness's check would fail for a wrong multi-part view."""
    d, seq = _three_runs(5)
    d.step({seq: 2})
    q = d.rng.standard_normal((2, 2, 2, 8)).astype(np.float32)  # [T, layers, heads, dim]
    d.step({seq: 1}, q=q[:1])
    assert np.isfinite(d.last).all()
    for layer in (0, 1):
        (view,) = d.last_views[layer]
        good = view_attention([view], q[:1, layer])
        np.testing.assert_allclose(good, d.last[:1, layer], atol=TOL)
        dropped = dataclasses.replace(view, parts=view.parts[:-1])  # the run holding the row itself
        assert _noticed(dropped, q[:1, layer], good)
    # the sliding layer's masked part, its mask shifted by one key
    (view,) = d.last_views[1]
    i = next(
        k for k, p in enumerate(view.parts) if p.mask is not None and 0 < np.array(p.mask).sum() < p.mask.size
    )
    part = view.parts[i]
    shifted = dataclasses.replace(part, mask=mx.array(np.roll(np.array(part.mask), 1, axis=1)))
    wrong = KVView(view.rows, None, None, None, parts=(*view.parts[:i], shifted, *view.parts[i + 1 :]))
    assert _noticed(wrong, q[:1, 1], d.last[:1, 1])


def test_a_view_with_parts_refuses_keys_and_needs_parts_or_keys() -> None:
    k = mx.zeros((2, 3, 8))
    with pytest.raises(ValueError):
        KVView(slice(0, 1), None, None, None)
    with pytest.raises(ValueError):
        KVView(slice(0, 1), k, k, None, parts=())
