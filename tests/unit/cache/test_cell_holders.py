"""batched-cell past 64 sequences: a cell counts its holders (no owner-bit limit), a shared cell is freed
exactly when its last holder leaves, and sequences with ids >= 64 attend exactly their own cells.

Expected counts are hand-computed from the operations; attention is checked against the harness's naive
reference over each sequence's true history.
"""

from __future__ import annotations

from tests.unit.cache.harness import TOL, Driver, geometry

N = 100  # sequences: well past the 64 a uint64 owner mask could name


def test_shared_cells_are_freed_exactly_with_their_last_holder() -> None:
    d = Driver("batched-cell", geometry(3, capacity=2048, max_seqs=N))
    src = d.new()
    d.fill(src, 6)
    shared = d.cache.cells(src)
    clones = [d.clone(src, 6) for _ in range(N - 1)]
    assert None not in clones and max(clones) >= 64
    assert d.cache.seq_new() is None  # N sequences: the id pool is the only limit
    assert d.cache.used() == 6  # clones copy nothing
    assert d.cache.cell_info(shared)[1].tolist() == [N] * 6
    for c in clones[-3:]:  # ids >= 64 write their own rows and read the shared ones exactly
        assert d.step({c: 2}) < TOL
    assert d.step({src: 1, clones[-1]: 1, clones[0]: 1}) < TOL
    own = 2 * 3 + 1 + 1 + 1
    assert d.cache.used() == 6 + own
    d.rm(src)  # the first holder leaves: every shared cell stays, only its own row goes
    assert d.cache.used() == 6 + own - 1
    assert d.cache.cell_info(shared)[1].tolist() == [N - 1] * 6
    assert d.rewind(clones[0], 2)  # drops its hold on shared positions 2..5 and its own row
    assert d.cache.cell_info(shared)[1].tolist() == [N - 1] * 2 + [N - 2] * 4
    used = d.cache.used()
    assert used == 6 + own - 2
    for c in clones[1:-1]:
        d.rm(c)
    assert d.cache.used() == used - 2 - 2  # only the removed clones' own rows went
    assert d.cache.cell_info(shared)[1].tolist() == [2] * 2 + [1] * 4
    d.rm(clones[-1])  # positions 2..5 lose their last holder: freed with it, not before
    assert d.cache.used() == 2
    assert d.cache.cell_info(shared)[1].tolist() == [1] * 2 + [0] * 4
    assert d.step({clones[0]: 3}) < TOL  # the survivor still reads its two shared rows exactly
    d.rm(clones[0])
    assert d.cache.used() == 0


def test_freed_cells_are_reused_by_new_sequences() -> None:
    d = Driver("batched-cell", geometry(3, capacity=12, max_seqs=N))
    a = d.new()
    d.fill(a, 12)
    kids = [d.clone(a, 12) for _ in range(70)]
    assert d.new() is not None and not d.cache.can_admit(kids[0], 1)  # the pool is full
    d.rm(a)
    for k in kids[:-1]:
        d.rm(k)
    assert not d.cache.can_admit(kids[-1], 1)  # one holder left: nothing freed yet
    d.rm(kids[-1])
    b = d.new()
    assert d.cache.can_admit(b, 3) and d.step({b: 3}) < TOL


def test_a_prompt_longer_than_its_region_takes_one_free_run_elsewhere() -> None:
    # 40 cells, 10 sequences: regions of 4. Sequence 1 holds cell 4 of its region; sequence 0 (region
    # 0..3) then writes 9 rows: no region fits, and the lowest free cells (0..3, 5..9) would split it;
    # the first free run of 9 anywhere is 5..13 (hand-computed).
    d = Driver("batched-cell", geometry(16, capacity=40, max_seqs=10))
    a, b = d.new(), d.new()
    assert d.step({b: 1}) < TOL and d.cache.cells(b).tolist() == [4]
    assert d.step({a: 9}) < TOL
    assert d.cache.cells(a).tolist() == list(range(5, 14))
