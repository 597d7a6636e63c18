"""``batched-sequence``: one :class:`SequenceCache` per sequence sharing one token capacity (a sequence
holds its committed positions); a step's view points at the sequence's own buffers ("causal" or None
on flat layers, a bool mask over the slots on rings)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine_service.api.errors import CacheError
from engine_service.cache.batch_control import KVPart, KVView, LayerIO, Segment
from engine_service.cache.config import CacheConfig, ConfiguredCache
from engine_service.cache.frozen_rows import held_rows
from engine_service.cache.pinned_state import PinnedState
from engine_service.cache.seq_ids import SeqIdPool, check_position, check_segments, check_step_kv
from engine_service.cache.seq_state import SeqState, layout_problem
from engine_service.cache.sequence_cache import SequenceCache
from engine_service.cache.sequence_snapshot import export_state, pin_state, restore_state, state_layout


@dataclass(frozen=True)
class _Part:
    """One segment of a step, resolved: where its rows sit in the packed order and where they go."""

    cache: SequenceCache
    offset: int
    start: int
    length: int


class SequenceStep:
    """KVStep over per-sequence buffers. Created by :meth:`BatchedSequenceCache.begin_step`."""

    def __init__(self, segments: Sequence[Segment], parts: list[_Part], config: CacheConfig) -> None:
        self.segments = tuple(segments)
        self._parts = parts
        self._cfg = config
        self._total = sum(p.length for p in parts)
        # ring masks depend only on (segment, window geometry): built once per step, shared by layers
        self._masks: dict[tuple[int, int], mx.array | None] = {}
        self._positions: dict[tuple[int, int | None], mx.array] = {}  # (segment, ring slots or None)
        # (segment, window): a flat-laid sliding layer's masks, one per part (the MLX path reads them)
        self._window_masks: dict[tuple[int, int], list[mx.array]] = {}
        # the batched K/V write where one is configured and the stream is the CPU's (decided per step)
        self._kv_store = config.kv_store if mx.default_device() == mx.cpu else None

    def views(self, layer: int, keys: mx.array, values: mx.array) -> list[KVView]:
        """keys, values: [T, kv_heads, head_dim] packed in segment order. One view per segment."""
        cfg = self._cfg
        check_step_kv(cfg, layer, self._total, keys, values)
        keys = keys if keys.dtype == cfg.dtype else keys.astype(cfg.dtype)
        values = values if values.dtype == cfg.dtype else values.astype(cfg.dtype)
        if self._kv_store is not None:  # every part's rows in one op (see CacheConfig.kv_store)
            self._store(layer, keys, values)
        else:
            k_t, v_t = keys.transpose(1, 0, 2), values.transpose(1, 0, 2)  # [kv_heads, T, head_dim]
            for part in self._parts:
                rows = slice(part.offset, part.offset + part.length)
                part.cache.write(layer, part.start, k_t[:, rows, :], v_t[:, rows, :])
        out = []
        for i, part in enumerate(self._parts):
            rows = slice(part.offset, part.offset + part.length)
            k_view, v_view = part.cache.view(layer, part.start + part.length)
            ring = part.cache.is_ring(layer)
            if part.cache.pieces and not ring:
                out.append(self._pieced_view(i, part, layer, rows, k_view, v_view))
                continue
            mask = self._ring_mask(i, part, layer) if ring else self._flat_mask(i, part, layer)
            positions = self._own_positions(i, part, layer)
            out.append(KVView(rows=rows, keys=k_view, values=v_view, mask=mask, positions=positions))
        return out

    def layer_io(self, layer: int) -> LayerIO | None:
        """:meth:`views` for one layer op (``forkline_kernels.DecoderLayer``); None without kv_store."""
        if self._kv_store is None:
            return None
        writes = self._writes(layer)
        buffers = [part.cache.buffers(layer) for part in self._parts]
        parts: list[tuple] = []
        groups = []
        for i, part in enumerate(self._parts):
            cache, before = part.cache, len(parts)
            if cache.is_ring(layer):
                self._ring_mask(i, part, layer)  # counts stale reads, as a view does
            elif cache.pieces:
                parts.extend((-1, 0, 0, p.keys[layer], p.values[layer], p.positions) for p in cache.pieces)
            rows = cache.view_rows(layer, part.start + part.length)
            parts.append((i, 0, rows, None, None, self._own_positions(i, part, layer)))
            groups.append((part.offset, part.offset + part.length, len(parts) - before))
        keys, values = [b[0] for b in buffers], [b[1] for b in buffers]
        return LayerIO(keys, values, writes, parts, groups if len(groups) > 1 else [])

    def commit(self, layer: int, keys: list[mx.array], values: list[mx.array]) -> None:
        """Hold a layer op's updated buffers (one per segment, in order)."""
        for part, k, v in zip(self._parts, keys, values, strict=True):
            part.cache.set_buffers(layer, k, v)

    def _ring_mask(self, i: int, part: _Part, layer: int) -> mx.array:
        key = (i, self._cfg.layers[layer].window)
        if key not in self._masks:
            self._masks[key] = mx.array(part.cache.ring_mask(layer, part.start, part.length))
        return self._masks[key]

    def _own_positions(self, i: int, part: _Part, layer: int) -> mx.array:
        """Key positions of the part's own buffer view: flat from ``tail_start``, a ring's by slot."""
        slots = part.cache.slots(layer) if part.cache.is_ring(layer) else None
        if (i, slots) not in self._positions:
            end = part.start + part.length
            self._positions[(i, slots)] = (
                mx.arange(part.cache.tail_start, end, dtype=mx.int32)
                if slots is None
                else mx.array(part.cache.ring_positions(layer, part.start, part.length))
            )
        return self._positions[(i, slots)]

    def _flat_mask(self, i: int, part: _Part, layer: int) -> mx.array | str | None:
        """A flat view's mask: None (one row) or "causal", a bool [n, end] where a window hides rows."""
        window = part.cache.window(layer)
        if window is None or part.start + part.length - window <= 0:
            return None if part.length == 1 else "causal"
        return self._part_masks(i, part, window)[0]

    def _part_masks(self, i: int, part: _Part, window: int) -> list[mx.array]:
        """Per part of segment ``i`` (its pieces, then its tail), which keys each query reads in ``window``."""
        if (i, window) not in self._window_masks:
            cache, end = part.cache, part.start + part.length
            bounds = [(p.start, p.end) for p in cache.pieces] + [(cache.tail_start, end)]
            self._window_masks[(i, window)] = [
                mx.array(_visible(np.arange(a, b), part.start, end, window)) for a, b in bounds
            ]
        return self._window_masks[(i, window)]

    def _pieced_view(
        self, i: int, part: _Part, layer: int, rows: slice, keys: mx.array, values: mx.array
    ) -> KVView:
        """A flat-laid layer read from the shared pieces (visible within its window) and the tail (causal
        over the step)."""
        cache, window = part.cache, part.cache.window(layer)
        end = part.start + part.length
        positions = self._own_positions(i, part, layer)
        if (i, 0) not in self._masks:
            tail = np.arange(cache.tail_start, end)
            self._masks[(i, 0)] = (
                None if part.length == 1 else mx.array(_visible(tail, part.start, end, None))
            )
        masks: list[mx.array | None] = [None] * len(cache.pieces) + [self._masks[(i, 0)]]
        if window is not None and end - window > 0:  # rows below a query's window hidden (MLX path)
            masks = list(self._part_masks(i, part, window))
        pieces = tuple(
            KVPart(p.keys[layer], p.values[layer], m, p.positions)
            for p, m in zip(cache.pieces, masks, strict=False)
        )
        tail = KVPart(keys, values, masks[-1], positions)
        return KVView(rows=rows, keys=None, values=None, mask=None, parts=(*pieces, tail))

    def _store(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Write a step's K/V [T, kv_heads, head_dim] with one ``kv_store`` op; the caches then hold its
        outputs, so the op holds a buffer's only reference and updates it in place."""
        writes = self._writes(layer)
        buffers = [part.cache.buffers(layer) for part in self._parts]
        new_keys, new_values = self._kv_store(
            keys, values, [b[0] for b in buffers], [b[1] for b in buffers], writes
        )
        for part, k, v in zip(self._parts, new_keys, new_values, strict=True):
            part.cache.set_buffers(layer, k, v)

    def _writes(self, layer: int) -> list[tuple[int, int, int, int]]:
        """``kv_store``'s writes (segment, packed row, buffer row, rows), growing the buffers as needed."""
        return [
            (i, part.offset + offset, index, rows)
            for i, part in enumerate(self._parts)
            for index, offset, rows in part.cache.write_runs(layer, part.start, part.length)
        ]

    def state(self) -> list[mx.array]:
        return [a for part in self._parts for a in part.cache.arrays()]


def _distinct_rows(seqs: list[SequenceCache]) -> int:
    """Rows the sequences hold laid out flat: each shared block once, every tail."""
    return held_rows(p for s in seqs for p in s.pieces) + sum(s.length - s.tail_start for s in seqs)


def _visible(keys: np.ndarray, start: int, end: int, window: int | None) -> np.ndarray:
    """bool [end - start, len(keys)]: query position q in [start, end) reads key position k when k <= q
    and, with a window, k > q - window."""
    q = np.arange(start, end)[:, None]
    ok = keys[None, :] <= q
    return ok if window is None else ok & (keys[None, :] > q - window)


class BatchedSequenceCache(ConfiguredCache):
    """BatchControl over independent per-sequence caches."""

    def __init__(self, config: CacheConfig) -> None:
        self._cfg = config
        self._ids = SeqIdPool(config.max_seqs)
        self._seqs: dict[int, SequenceCache] = {}

    def used(self) -> int:
        """Token rows held across all sequences (counted against ``capacity``), in whole positions of every
        layer: each distinct flat-laid row once (a clone shares them), a wrapped ring's rows per sequence
        (a clone copies them)."""
        return self._rows_with(0)

    def _rows_with(self, ring_positions: int) -> int:
        """:meth:`used` with ``ring_positions`` more positions of ring rows (a clone's copy)."""
        layers = self._cfg.layers
        rings = sum(spec.sliding for spec in layers)
        seqs = list(self._seqs.values())
        flat_laid = [s for s in seqs if not s.wrapped]
        distinct = _distinct_rows(seqs)
        ring_rows = _distinct_rows(flat_laid) + sum(s.length for s in seqs if s.wrapped) + ring_positions
        return -(-((len(layers) - rings) * distinct + rings * ring_rows) // len(layers))

    def sequence(self, seq: int) -> SequenceCache:
        """The per-sequence cache (tests, diagnostics)."""
        return self._seqs[self._ids.check(seq)]

    def stale_reads(self) -> int:
        return sum(s.stale_reads for s in self._seqs.values())

    def seq_new(self) -> int | None:
        sid = self._ids.acquire()
        if sid is not None:
            self._seqs[sid] = SequenceCache(self._cfg)
        return sid

    def seq_clone(self, src: int, upto: int) -> int | None:
        source = self.sequence(src)
        check_position("upto", upto)
        # a clone shares the flat-laid rows and copies wrapped rings
        copied = upto if source.wrapped else 0
        if self._rows_with(copied) > self._cfg.capacity or not source.can_rewind(upto):
            return None
        sid = self._ids.acquire()
        if sid is None:
            return None
        try:
            dup = source.copy(upto)
        except Exception:
            self._ids.release(sid)
            raise
        if dup is None:  # unreachable after can_rewind, kept so a refusal never leaks the id
            self._ids.release(sid)
            return None
        self._seqs[sid] = dup
        return sid

    def rewind_floor(self, seq: int) -> int:
        """The lowest position a clone or rewind of ``seq`` may reach (its rings' floor; 0 without rings)."""
        return self.sequence(seq).rewind_floor

    def seq_rm(self, seq: int) -> None:
        self._ids.release(seq)
        del self._seqs[seq]

    def export_seq(self, seq: int, upto: int) -> SeqState | None:
        """Positions ``[0, upto)`` of ``seq`` (:func:`.sequence_snapshot.export_state`), or None."""
        return export_state(self.sequence(seq), check_position("upto", upto))

    def pin_seq(self, seq: int) -> PinnedState | None:
        """``seq``'s committed positions pinned for exports on any thread (views, no copy)."""
        return pin_state(self.sequence(seq))

    def state_problem(self, state: SeqState) -> str | None:
        """Why ``state`` cannot be imported into this cache's geometry (None: its layout fits)."""
        return layout_problem(state, state_layout(self._cfg, state.length, state.written))

    def import_seq(self, state: SeqState) -> int | None:
        """A new sequence holding ``state``, or None (no slot or room); nothing changes on a refusal."""
        if self.used() + state.length > self._cfg.capacity:
            return None
        sid = self._ids.acquire()
        if sid is None:
            return None
        try:
            self._seqs[sid] = restore_state(self._cfg, state)
        except Exception:
            self._ids.release(sid)
            raise
        return sid

    def can_rewind(self, seq: int, length: int) -> bool:
        return self.sequence(seq).can_rewind(check_position("length", length))

    def rewind(self, seq: int, length: int) -> bool:
        return self.sequence(seq).rewind(check_position("length", length))

    def pos(self, seq: int) -> int:
        return self.sequence(seq).length

    def can_admit(self, seq: int, n: int) -> bool:
        cache = self.sequence(seq)
        return cache.can_write(n) and self.used() + n <= self._cfg.capacity

    def begin_step(self, segments: Sequence[Segment]) -> SequenceStep:
        pos = {sid: s.length for sid, s in self._seqs.items()}
        total = check_segments(segments, self._ids, pos)
        if self.used() + total > self._cfg.capacity:
            raise CacheError(
                f"step of {total} rows exceeds capacity {self._cfg.capacity} ({self.used()} used)"
            )
        for seg in segments:
            if not self._seqs[seg.seq].can_write(seg.length):
                raise CacheError(f"segment {seg} is not admissible (check can_admit first)")
        parts, offset = [], 0
        for seg in segments:  # all checks passed: nothing below can refuse
            cache = self._seqs[seg.seq]
            parts.append(_Part(cache, offset, cache.reserve(seg.length), seg.length))
            offset += seg.length
        return SequenceStep(segments, parts, self._cfg)

    def clear(self) -> None:
        self._seqs.clear()
        self._ids.clear()
