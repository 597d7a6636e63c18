"""Where a cell cache puts new rows: a free map over ``capacity`` cells with placement hints.

Placement matters for speed, not correctness: a sequence whose cells form one ascending run is read
as a plain slice of the pool with a causal mask (no gather, no explicit mask). So

1. a sequence continues its own run (the cells right after its last cell) when they are free;
2. else it starts at the first free run in its *region*: the pool is split into ``max_seqs`` equal
   regions and sequence ``s`` prefers region ``s`` (packed prefills of several sequences then do not
   interleave);
3. else it takes the lowest free cells anywhere (fragmented, still correct: the reader gathers).

Pure numpy bookkeeping; the K/V storage belongs to :class:`engine_service.cache.cell_cache.CellCache`.
"""

from __future__ import annotations

import numpy as np


class CellAllocator:
    """Free map of ``capacity`` cells. ``take`` never hands out a used cell; the caller checks room."""

    def __init__(self, capacity: int, max_seqs: int) -> None:
        self._free = np.ones(capacity, dtype=bool)  # [capacity]
        self._used = 0
        self._region = max(1, capacity // max_seqs)

    @property
    def used(self) -> int:
        return self._used

    @property
    def available(self) -> int:
        return len(self._free) - self._used

    def take(self, seq: int, after: int | None, n: int) -> np.ndarray:
        """``n`` free cells for sequence ``seq`` whose last cell is ``after`` (None: it has none).

        Returns int64 [n], ascending. Raises ValueError when fewer than ``n`` cells are free.
        """
        if n > self.available:
            raise ValueError(f"{n} cells requested, {self.available} free")
        cells = self._run_at(after + 1, n) if after is not None else None
        if cells is None:
            lo = min(seq * self._region, len(self._free))
            cells = self._first_run(lo, min(lo + self._region, len(self._free)), n)
        if cells is None:
            cells = np.flatnonzero(self._free)[:n]
        self._free[cells] = False
        self._used += n
        return cells.astype(np.int64)

    def release(self, cells: np.ndarray) -> None:
        self._free[cells] = True
        self._used -= len(cells)

    def _run_at(self, start: int, n: int) -> np.ndarray | None:
        if start + n <= len(self._free) and self._free[start : start + n].all():
            return np.arange(start, start + n)
        return None

    def _first_run(self, lo: int, hi: int, n: int) -> np.ndarray | None:
        """The first ``n`` consecutive free cells inside ``[lo, hi)``, or None."""
        if hi - lo < n:
            return None
        counts = np.concatenate([[0], np.cumsum(self._free[lo:hi])])  # free cells before each index
        fits = np.flatnonzero(counts[n:] - counts[:-n] == n)
        return None if len(fits) == 0 else np.arange(lo + fits[0], lo + fits[0] + n)
