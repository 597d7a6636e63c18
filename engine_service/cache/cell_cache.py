"""``batched-cell``: one shared pool of cells per layer ([kv_heads, alloc, head_dim]), each cell with a
position and a reference count (numpy, once for every layer); each sequence lists its own cells. A
clone lists the source's cells and counts one more holder (no K/V copied), a rewind drops the tail, a
cell is freed with its last holder. Nothing is evicted for a window: the mask restricts it. Spec:
docs/ENGINE.md (The KV cache: batched-cell)."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from engine_service.api.errors import CacheError
from engine_service.cache.batch_control import Segment
from engine_service.cache.cell_allocator import CellAllocator
from engine_service.cache.cell_step import CellPool, CellStep, as_dtype
from engine_service.cache.config import CacheConfig, ConfiguredCache
from engine_service.cache.seq_ids import SeqIdPool, check_position, check_segments
from engine_service.cache.seq_state import SeqState, layout_problem


class _Cells:
    """A sequence's cell index per position: ``idx[:n]`` (grows by doubling)."""

    __slots__ = ("idx", "n")

    def __init__(self, idx: np.ndarray | None = None) -> None:
        self.idx = np.empty(16, dtype=np.int64) if idx is None else idx
        self.n = 0 if idx is None else len(idx)

    def held(self) -> np.ndarray:
        return self.idx[: self.n]

    def append(self, cells: np.ndarray) -> None:
        need = self.n + len(cells)
        if need > len(self.idx):
            grown = np.empty(max(need, 2 * len(self.idx)), dtype=np.int64)
            grown[: self.n] = self.idx[: self.n]
            self.idx = grown
        self.idx[self.n : need] = cells
        self.n = need


def _cell_index(cells: np.ndarray) -> slice | mx.array:
    """How to address ``cells`` (ascending or not) in a pool: one slice when they form one run."""
    if len(cells) and int(cells[-1]) - int(cells[0]) + 1 == len(cells) and bool(np.all(np.diff(cells) == 1)):
        return slice(int(cells[0]), int(cells[-1]) + 1)
    return mx.array(cells.astype(np.int32))


class CellCache(ConfiguredCache):
    """BatchControl over a shared cell pool. Capacity counts used cells."""

    def __init__(self, config: CacheConfig) -> None:
        self._cfg = config
        self._ids = SeqIdPool(config.max_seqs)
        self._cells: dict[int, _Cells] = {}
        self._slots = CellAllocator(config.capacity, config.max_seqs)
        # bookkeeping covers every cell up front (cheap numpy); K/V storage grows lazily to ``_alloc``
        self._cell_pos = np.full(config.capacity, -1, dtype=np.int64)  # [capacity]
        self._refs = np.zeros(config.capacity, dtype=np.int32)  # [capacity] sequences holding each cell
        self._alloc = 0
        self._keys: list[mx.array] = []  # per layer [kv_heads, alloc, head_dim]
        self._values: list[mx.array] = []

    def used(self) -> int:
        """Cells in use (owned by at least one sequence)."""
        return self._slots.used

    def cells(self, seq: int) -> np.ndarray:
        """The cell of each position of ``seq`` (a copy; tests and diagnostics)."""
        return self._cells[self._ids.check(seq)].held().copy()

    def cell_info(self, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions, holder counts) of ``cells`` (copies)."""
        return self._cell_pos[cells].copy(), self._refs[cells].copy()

    def seq_new(self) -> int | None:
        sid = self._ids.acquire()
        if sid is not None:
            self._cells[sid] = _Cells()
        return sid

    def seq_clone(self, src: int, upto: int) -> int | None:
        source = self._cells[self._ids.check(src)]
        check_position("upto", upto)
        if upto > source.n:
            return None
        sid = self._ids.acquire()
        if sid is None:
            return None
        shared = source.held()[:upto].copy()
        self._refs[shared] += 1
        self._cells[sid] = _Cells(shared)
        return sid

    def export_seq(self, seq: int, upto: int) -> SeqState | None:
        """Positions ``[0, upto)`` of ``seq`` gathered from its cells in position order (evaluated), or None."""
        held = self._cells[self._ids.check(seq)]
        if check_position("upto", upto) > held.n:
            return None
        at = _cell_index(held.held()[:upto])
        arrays = {}
        for layer in range(len(self._cfg.layers)):
            for name, pool in (("keys", self._keys), ("values", self._values)):
                arrays[f"layers.{layer}.{name}"] = (
                    mx.zeros((self._cfg.kv_heads, 0, self._cfg.head_dim), dtype=self._cfg.dtype)
                    if upto == 0
                    else pool[layer][:, at, :]
                    if isinstance(at, slice)
                    else mx.take(pool[layer], at, axis=1)
                )
        mx.eval(list(arrays.values()))
        return SeqState(upto, upto, arrays)

    def state_problem(self, state: SeqState) -> str | None:
        """Why ``state`` cannot be imported into this pool's geometry (None: its layout fits)."""
        cfg = self._cfg
        shape = ((cfg.kv_heads, state.length, cfg.head_dim), cfg.dtype)
        return layout_problem(
            state,
            {f"layers.{i}.{name}": shape for i in range(len(cfg.layers)) for name in ("keys", "values")},
        )

    def import_seq(self, state: SeqState) -> int | None:
        """A new sequence owning fresh cells that hold ``state``, or None (no id, too few cells); nothing
        changes on a refusal or a failure."""
        if state.length > self._slots.available:
            return None
        sid = self.seq_new()
        if sid is None or state.length == 0:
            return sid
        try:
            cells = self._slots.take(sid, None, state.length)
            self._cell_pos[cells] = np.arange(state.length)
            self._refs[cells] = 1
            self._cells[sid].append(cells)
            self._grow(int(cells.max()) + 1)
            at = _cell_index(cells)
            for layer in range(len(self._cfg.layers)):
                self._keys[layer][:, at, :] = as_dtype(state.arrays[f"layers.{layer}.keys"], self._cfg.dtype)
                self._values[layer][:, at, :] = as_dtype(
                    state.arrays[f"layers.{layer}.values"], self._cfg.dtype
                )
            mx.eval([*self._keys, *self._values])
        except Exception:
            self.seq_rm(sid)
            raise
        return sid

    def seq_rm(self, seq: int) -> None:
        self._drop(self._ids.check(seq), 0)
        self._ids.release(seq)
        del self._cells[seq]

    def rewind(self, seq: int, length: int) -> bool:
        held = self._cells[self._ids.check(seq)]
        if check_position("length", length) > held.n:
            return False
        self._drop(seq, length)
        return True

    def _drop(self, seq: int, length: int) -> None:
        """Release ``seq``'s hold on its cells at positions >= ``length``; free orphaned cells."""
        held = self._cells[seq]
        gone = held.held()[length:]  # distinct cells: a sequence holds each of its cells once
        if len(gone):
            self._refs[gone] -= 1
            orphans = gone[self._refs[gone] == 0]
            self._cell_pos[orphans] = -1
            self._slots.release(orphans)
        held.n = length

    def pos(self, seq: int) -> int:
        return self._cells[self._ids.check(seq)].n

    def can_admit(self, seq: int, n: int) -> bool:
        self._ids.check(seq)
        return n >= 1 and n <= self._slots.available

    def _grow(self, top: int) -> None:
        """Make the K/V storage cover cells ``[0, top)`` (doubling, in steps of initial_capacity)."""
        if top <= self._alloc:
            return
        cfg = self._cfg
        step = cfg.initial_capacity
        target = min(cfg.capacity, max(2 * self._alloc, -(-top // step) * step))
        pad = mx.zeros((cfg.kv_heads, target - self._alloc, cfg.head_dim), dtype=cfg.dtype)
        if not self._keys:  # separate buffers per layer and for K and V: in-place updates need sole owners
            self._keys = [mx.zeros(pad.shape, dtype=cfg.dtype) for _ in cfg.layers]
            self._values = [mx.zeros(pad.shape, dtype=cfg.dtype) for _ in cfg.layers]
        else:
            self._keys = [mx.concatenate([k, pad], axis=1) for k in self._keys]
            self._values = [mx.concatenate([v, pad], axis=1) for v in self._values]
        self._alloc = target

    def begin_step(self, segments: Sequence[Segment]) -> CellStep:
        pos = {sid: c.n for sid, c in self._cells.items()}
        total = check_segments(segments, self._ids, pos)
        if total > self._slots.available:
            raise CacheError(
                f"step of {total} rows exceeds capacity {self._cfg.capacity} ({self.used()} used)"
            )
        parts = []
        for seg in segments:  # all checks passed: nothing below can refuse
            held = self._cells[seg.seq]
            cells = self._slots.take(seg.seq, int(held.idx[held.n - 1]) if held.n else None, seg.length)
            self._cell_pos[cells] = np.arange(seg.start, seg.start + seg.length)
            self._refs[cells] = 1
            held.append(cells)
            parts.append(cells)
        new = np.concatenate(parts)  # [T] cell of each packed row
        self._grow(int(new.max()) + 1)
        pool = CellPool(self._cfg, self._keys, self._values, self._cell_pos)
        return CellStep(pool, {seg.seq: self._cells[seg.seq].held() for seg in segments}, segments, new)

    def clear(self) -> None:
        for sid in list(self._cells):
            self.seq_rm(sid)
