"""The packed step of ``batched-cell``: one view per segment over the pool cells its sequence owns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from engine_service.cache.batch_control import KVPart, KVView, LayerIO, Segment
from engine_service.cache.seq_ids import check_step_kv

if TYPE_CHECKING:
    from engine_service.cache.config import CacheConfig


@dataclass(frozen=True)
class CellPool:
    """The pool a step reads and writes: the cache's own arrays, shared, not copied."""

    cfg: CacheConfig
    keys: list[mx.array]  # per layer [kv_heads, alloc, head_dim]
    values: list[mx.array]
    cell_pos: np.ndarray  # [capacity] position each cell holds (-1: free)


# a sequence whose cells form at most this many runs is read as that many pool slices (one attention
# softmax across them) instead of a gather that copies its whole context every layer of every step
MAX_PARTS = 4


@dataclass(frozen=True)
class SegmentRead:
    """Which pool cells one segment's rows attend: ``cells`` int64 [U] in view order, ``owned`` bool [U]
    whether the sequence holds each; ``span`` the pool slice [lo, hi) (else ``take`` gathers);
    ``contiguous``: its cells are lo .. hi - 1 in position order; ``runs``: pool slices instead."""

    seq: int
    rows: slice
    qpos: np.ndarray  # [n] positions of the segment's rows
    cells: np.ndarray
    owned: np.ndarray
    span: tuple[int, int] | None
    take: mx.array | None
    contiguous: bool
    runs: tuple[tuple[int, int], ...] | None = None


def segment_read(seg: Segment, own: np.ndarray, offset: int) -> SegmentRead:
    """How ``seg`` (packed rows from ``offset``) reads its sequence's cells (``own``: int64 [pos])."""
    lo, hi = int(own.min()), int(own.max()) + 1
    breaks = np.flatnonzero(np.diff(own) != 1) + 1  # where a new ascending run starts
    rows, qpos = slice(offset, offset + seg.length), np.arange(seg.start, seg.start + seg.length)
    # a gather reads+writes U cells before attention reads them again; a slice is free but attention
    # then reads the whole span: slice when the owned cells fill half of it; else read a few runs as
    # parts (no copy), and gather only a badly fragmented sequence
    sliced = 2 * len(own) >= hi - lo
    if not sliced and len(breaks) < MAX_PARTS:
        edges = [0, *breaks.tolist(), len(own)]
        runs = tuple((int(own[a]), int(own[b - 1]) + 1) for a, b in zip(edges[:-1], edges[1:], strict=True))
        every = np.ones(len(own), dtype=bool)
        return SegmentRead(seg.seq, rows, qpos, own.copy(), every, None, None, contiguous=False, runs=runs)
    if sliced:  # the span also covers cells of other sequences: mark the sequence's own
        cells, owned = np.arange(lo, hi), np.zeros(hi - lo, dtype=bool)
        owned[own - lo] = True
    else:
        cells, owned = np.sort(own), np.ones(len(own), dtype=bool)
    take = None if sliced else mx.array(cells.astype(np.int32))
    span = (lo, hi) if sliced else None
    return SegmentRead(seg.seq, rows, qpos, cells, owned, span, take, len(breaks) == 0)


class CellStep:
    """KVStep over the shared pool (from :meth:`CellCache.begin_step`): per segment a pool slice when its
    cells fill half of it, a few runs as parts, else a gather; masks built once per (segment, window)."""

    def __init__(
        self,
        pool: CellPool,
        held: Mapping[int, np.ndarray],
        segments: Sequence[Segment],
        new_cells: np.ndarray,
    ) -> None:
        self.segments = tuple(segments)
        self._pool = pool
        self._new = new_cells  # [T] cell of each packed row
        lo, hi = int(new_cells[0]), int(new_cells[-1])
        # fresh cells usually come off the free stack as one ascending run: a slice update suffices
        run = hi - lo + 1 == len(new_cells) and bool(np.all(np.diff(new_cells) == 1))
        self._run = (lo, hi + 1) if run else None
        self._new_mx = None if run else mx.array(new_cells.astype(np.int32))
        self._reads: list[SegmentRead] = []
        offset = 0
        for seg in segments:
            # [pos] cell of each position, new rows included
            self._reads.append(segment_read(seg, held[seg.seq], offset))
            offset += seg.length
        self._masks: dict[tuple[int, int | None], mx.array | str | None] = {}
        self._part_masks: dict[tuple[int, int | None], tuple[mx.array | None, ...]] = {}
        self._positions: dict[int, tuple[mx.array, ...]] = {}

    def _key_positions(self, i: int) -> tuple[mx.array, ...]:
        """int32 positions of segment ``i``'s view cells (per run): the cell's where the sequence holds it,
        else -1."""
        if i not in self._positions:
            read = self._reads[i]
            pos = np.where(read.owned, self._pool.cell_pos[read.cells], -1).astype(np.int32)
            if read.runs:
                edges = np.cumsum([0] + [hi - lo for lo, hi in read.runs])
                self._positions[i] = tuple(
                    mx.array(pos[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)
                )
            else:
                self._positions[i] = (mx.array(pos),)
        return self._positions[i]

    def _np_mask(self, read: SegmentRead, window: int | None) -> np.ndarray:
        """bool [n, U]: held by the sequence, position <= the row's (and inside the window)."""
        pos = self._pool.cell_pos[read.cells][None, :]  # [1, U]
        q = read.qpos[:, None]  # [n, 1]
        mask = read.owned[None, :] & (pos <= q) & (pos >= 0)  # [n, U]
        if window is not None:
            mask &= pos > q - window
        return mask

    def _parts_mask(self, i: int, window: int | None) -> tuple[mx.array | None, ...]:
        """Per-run slices of segment ``i``'s mask (None where the run is visible to every row)."""
        key = (i, window)
        if key not in self._part_masks:
            read = self._reads[i]
            mask = self._np_mask(read, window)
            out = []
            at = 0
            for lo, hi in read.runs:
                m = mask[:, at : at + hi - lo]
                out.append(None if m.all() else mx.array(m))
                at += hi - lo
            self._part_masks[key] = tuple(out)
        return self._part_masks[key]

    def _mask(self, i: int, window: int | None) -> mx.array | str | None:
        """Mask of segment ``i`` on layers with this window (None = full): bool [n, U] or causal/None."""
        key = (i, window)
        if key not in self._masks:
            read = self._reads[i]
            if window is None and read.contiguous:
                # view index k holds position k, the segment's rows are the view's last rows
                self._masks[key] = None if len(read.qpos) == 1 else "causal"
            else:
                self._masks[key] = mx.array(self._np_mask(read, window))
        return self._masks[key]

    def views(self, layer: int, keys: mx.array, values: mx.array) -> list[KVView]:
        """keys, values: [T, kv_heads, head_dim] packed in segment order. One view per segment."""
        pool, cfg = self._pool, self._pool.cfg
        check_step_kv(cfg, layer, len(self._new), keys, values)
        k_t = as_dtype(keys, cfg.dtype).transpose(1, 0, 2)  # [kv_heads, T, head_dim]
        v_t = as_dtype(values, cfg.dtype).transpose(1, 0, 2)
        pool_k, pool_v = pool.keys, pool.values  # [kv_heads, alloc, head_dim] per layer
        if self._run:
            a, b = self._run
            pool_k[layer][:, a:b, :] = k_t
            pool_v[layer][:, a:b, :] = v_t
        else:
            pool_k[layer][:, self._new_mx, :] = k_t
            pool_v[layer][:, self._new_mx, :] = v_t
        window = cfg.layers[layer].window
        out = []
        for i, read in enumerate(self._reads):
            if read.runs:
                masks = self._parts_mask(i, window)
                parts = tuple(
                    KVPart(pool_k[layer][:, lo:hi, :], pool_v[layer][:, lo:hi, :], m, positions)
                    for (lo, hi), m, positions in zip(read.runs, masks, self._key_positions(i), strict=True)
                )
                out.append(KVView(rows=read.rows, keys=None, values=None, mask=None, parts=parts))
                continue
            if read.span:
                lo, hi = read.span
                k_view = pool_k[layer][:, lo:hi, :]  # [kv_heads, U = hi - lo, head_dim]
                v_view = pool_v[layer][:, lo:hi, :]
            else:
                k_view = mx.take(pool_k[layer], read.take, axis=1)  # [kv_heads, U, head_dim]
                v_view = mx.take(pool_v[layer], read.take, axis=1)
            out.append(
                KVView(
                    rows=read.rows,
                    keys=k_view,
                    values=v_view,
                    mask=self._mask(i, window),
                    positions=self._key_positions(i)[0],
                )
            )
        return out

    def layer_io(self, layer: int) -> LayerIO | None:
        """:meth:`views` for one layer op: each segment's span or runs as parts of the pool; None where a
        segment reads a gather."""
        if any(read.take is not None for read in self._reads):
            return None
        if self._run:
            writes = [(0, 0, self._run[0], self._run[1] - self._run[0])]
        else:
            writes = [(0, row, int(cell), 1) for row, cell in enumerate(self._new)]
        parts: list[tuple] = []
        groups = []
        for i, read in enumerate(self._reads):
            spans = read.runs or (read.span,)
            for (lo, hi), positions in zip(spans, self._key_positions(i), strict=True):
                parts.append((0, lo, hi - lo, None, None, positions))
            groups.append((read.rows.start, read.rows.stop, len(spans)))
        pool = self._pool
        return LayerIO(
            [pool.keys[layer]], [pool.values[layer]], writes, parts, groups if len(groups) > 1 else []
        )

    def commit(self, layer: int, keys: list[mx.array], values: list[mx.array]) -> None:
        """Hold a layer op's updated pool arrays."""
        self._pool.keys[layer], self._pool.values[layer] = keys[0], values[0]

    def state(self) -> list[mx.array]:
        return [*self._pool.keys, *self._pool.values]


def as_dtype(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)
