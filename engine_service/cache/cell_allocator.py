"""Where a cell cache puts new rows (placement is speed, not correctness: one ascending run reads as a
slice): continue the sequence's own run, else the first free run in its region (the pool split into
``max_seqs`` regions), else the first free run anywhere, else the lowest free cells. Spec:
docs/ENGINE.md (The KV cache: placement)."""

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
        """``n`` free cells (int64 [n], ascending) for ``seq`` whose last cell is ``after`` (None: none);
        ValueError when fewer are free."""
        if n > self.available:
            raise ValueError(f"{n} cells requested, {self.available} free")
        cells = self._run_at(after + 1, n) if after is not None else None
        if cells is None:
            lo = min(seq * self._region, len(self._free))
            cells = self._first_run(lo, min(lo + self._region, len(self._free)), n)
        if cells is None:  # regions shrink as sequences grow in number: a free run anywhere
            cells = self._first_run(0, len(self._free), n)
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
