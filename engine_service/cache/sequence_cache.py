"""K/V history of one sequence, per layer ``[kv_heads, alloc, head_dim]``: a flat layer holds positions
below ``tail_start`` as shared :class:`.frozen_rows.FrozenRows` pieces and row p >= tail_start at tail
index ``p - tail_start``; a sliding layer (window W, ``W + max_write`` slots: ``CacheConfig.ring_slots``)
is laid out as a flat one, its rows shared with clones, until a step would write past its slots: it then
becomes a ring (row p at ``p % slots``, copied per clone). ``written`` is a high-water mark rewinds never lower; :meth:`SequenceCache.can_rewind`
decides what is still there. Spec: docs/ENGINE.md (The KV cache: batched-sequence)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine_service.api.errors import CacheError
from engine_service.cache.config import RING_SPARE, CacheConfig
from engine_service.cache.frozen_rows import FrozenRows, coalesced, freeze, trim, without_layer


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class SequenceCache:
    """One sequence's per-layer K/V buffers. Not thread-safe (engine thread only)."""

    def __init__(self, config: CacheConfig) -> None:
        self._cfg = config
        self._length = 0
        self._written = 0
        self._pieces: tuple[FrozenRows, ...] = ()  # flat positions [0, tail_start), shared, read-only
        self._tail_start = 0
        n = len(config.layers)
        self._keys: list[mx.array | None] = [None] * n
        self._values: list[mx.array | None] = [None] * n
        # ring slot count per layer (None = flat layer); a sliding layer is a ring once it wrapped
        self._slots: list[int | None] = [
            config.ring_slots(spec.window) if spec.sliding else None for spec in config.layers
        ]
        self._ring: list[bool] = [False] * n
        # actual position held by each slot, per distinct slot count (-1 = never written); only used to
        # count stale reads, never to build masks.
        self._slot_pos: dict[int, np.ndarray] = {
            s: np.full(s, -1, dtype=np.int64) for s in set(self._slots) if s is not None
        }
        self.stale_reads = 0

    # ----------------------------------------------------------------- positions
    @property
    def length(self) -> int:
        """Positions committed (the next position to write)."""
        return self._length

    @property
    def written(self) -> int:
        """High-water mark: one past the highest position ever written into these buffers."""
        return self._written

    @property
    def has_ring(self) -> bool:
        return bool(self._slot_pos)

    @property
    def rewind_floor(self) -> int:
        """The lowest position a rewind or clone may reach: ``written - max_write`` with rings, else 0."""
        return max(0, self._written - self._cfg.max_write) if self.has_ring else 0

    def can_rewind(self, p: int) -> bool:
        """Whether ``length`` may become ``p``: not past the length nor below the rings' floor (from
        there a ring still holds the W - 1 rows before p after a full ``max_write`` step at p)."""
        if p < 0 or p > self._length:
            return False
        return p >= self.rewind_floor

    def rewind(self, p: int) -> bool:
        if not self.can_rewind(p):
            return False
        self._length = p
        self._cut_pieces(p)
        return True

    def _cut_pieces(self, p: int) -> None:
        """Positions from ``p`` on go to the tail (its index 0 becomes p; nothing past p is committed)."""
        if p < self._tail_start:
            self._pieces = trim(self._pieces, p)
            self._tail_start = p

    def take_back(self, start: int, written: int) -> None:
        """Undo the last step: ``length`` to ``start``, the mark to ``written`` (its value before the
        step). With ring layers a step of at most ``RING_SPARE`` rows (what it overwrote lies below the
        window of every position the old floor allows); ValueError otherwise, or for values not the step's."""
        too_long = self.has_ring and self._length - start > RING_SPARE
        if too_long or not start <= self._length or not start <= written <= self._written:
            raise ValueError(
                f"cannot take back to {start} / {written} (length {self._length}, rings {self.has_ring})"
            )
        self._length, self._written = start, written
        self._cut_pieces(start)

    def _force_rewind(self, p: int) -> None:
        """Test hook: set the length without :meth:`can_rewind` (the deliberately unsafe control)."""
        self._length = p
        self._cut_pieces(p)

    def can_write(self, n: int) -> bool:
        """Whether one step of ``n`` rows fits: ring layers take at most ``max_write``."""
        if n < 1 or self._length + n > self._cfg.capacity:
            return False
        return not (self.has_ring and n > self._cfg.max_write)

    def reserve(self, n: int) -> int:
        """Advance by ``n`` positions for a step whose rows arrive through :meth:`write`; returns the start."""
        if not self.can_write(n):
            raise CacheError(
                f"a step of {n} rows is not admissible at position {self._length} "
                f"(max_write {self._cfg.max_write}, capacity {self._cfg.capacity})"
            )
        start = self._length
        end = start + n
        for layer, slots in enumerate(self._slots):
            if slots is not None and end > slots and not self._ring[layer]:
                self._to_ring(layer, slots)
        positions = np.arange(start, end, dtype=np.int64)
        for slots, held in self._slot_pos.items():
            held[positions % slots] = positions
        self._length = end
        self._written = max(self._written, end)
        return start

    # ----------------------------------------------------------------- storage
    def _ensure(self, layer: int, need: int) -> None:
        """Grow ``layer``'s buffers so index ``need - 1`` exists (rings stop at their slot count, a flat
        tail at the capacity left above ``tail_start``)."""
        cfg = self._cfg
        slots = self._slots[layer]
        flat_limit = (cfg.capacity if slots is None else slots) - self._tail_start
        limit = slots if self._ring[layer] else flat_limit
        keys = self._keys[layer]
        have = 0 if keys is None else keys.shape[1]
        if need <= have:
            return
        target = min(limit, round_up(need, cfg.initial_capacity))
        pad = mx.zeros((cfg.kv_heads, target - have, cfg.head_dim), dtype=cfg.dtype)
        if keys is None:
            self._keys[layer] = pad
            # a separate buffer: two names on one buffer would defeat in-place slice updates
            self._values[layer] = mx.zeros(pad.shape, dtype=cfg.dtype)
        else:  # the pad is only read by the concatenations: one block serves keys and values
            self._keys[layer] = mx.concatenate([keys, pad], axis=1)
            self._values[layer] = mx.concatenate([self._values[layer], pad], axis=1)

    def write_runs(self, layer: int, start: int, n: int) -> list[tuple[int, int, int]]:
        """Grow ``layer`` for rows ``start .. start + n - 1`` (>= tail_start) and say where they go:
        ``(index, offset, rows)`` runs (one on a flat layer, two where a ring wraps)."""
        end = start + n
        slots = self._slots[layer]
        if not self._ring[layer]:
            self._ensure(layer, end - self._tail_start)
            return [(start - self._tail_start, 0, n)]
        self._ensure(layer, min(end, slots))
        a = start % slots
        first = min(n, slots - a)  # rows before the ring wraps (n <= max_write <= slots: wraps once)
        return [(a, 0, first)] if first == n else [(a, 0, first), (0, first, n - first)]

    def set_buffers(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Replace ``layer``'s buffers with updated ones of the same shape (a batched K/V write)."""
        self._keys[layer], self._values[layer] = keys, values

    @property
    def pieces(self) -> tuple[FrozenRows, ...]:
        """The shared read-only pieces holding flat positions ``[0, tail_start)``."""
        return self._pieces

    @property
    def tail_start(self) -> int:
        """The first flat position in this sequence's own buffers."""
        return self._tail_start

    def view(self, layer: int, end: int) -> tuple[mx.array, mx.array]:
        """``layer``'s own (keys, values) [kv_heads, S, head_dim] for a step ending at ``end``: S = end -
        tail_start flat (the tail; :attr:`pieces` hold the rest), ``min(end, slots)`` on a ring."""
        filled = self.view_rows(layer, end)
        # [:, :filled]: a trailing ":" doubles the slice's cost (~2.5 vs 1.3 us, twice a layer a step)
        return self._keys[layer][:, :filled], self._values[layer][:, :filled]

    def view_rows(self, layer: int, end: int) -> int:
        """The rows of :meth:`view`: the leading rows of ``layer``'s buffers a step ending at ``end`` reads."""
        return min(end, self._slots[layer]) if self._ring[layer] else end - self._tail_start

    def write(self, layer: int, start: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store keys, values [kv_heads, n, head_dim] (reserved rows from ``start``); returns :meth:`view`."""
        n = keys.shape[1]
        for index, offset, rows in self.write_runs(layer, start, n):
            self._keys[layer][:, index : index + rows, :] = keys[:, offset : offset + rows, :]
            self._values[layer][:, index : index + rows, :] = values[:, offset : offset + rows, :]
        return self.view(layer, start + n)

    def ring_mask(self, layer: int, start: int, n: int) -> np.ndarray:
        """bool [n, min(start + n, slots)]: query ``start + i`` may read slot j, assumed to hold the latest
        position < start + n congruent to j (reads of a slot that does not are counted in ``stale_reads``)."""
        slots = self._slots[layer]
        window = self._cfg.layers[layer].window
        end = start + n
        filled = min(end, slots)
        j = np.arange(filled, dtype=np.int64)
        assumed = end - 1 - ((end - 1 - j) % slots)  # [filled]
        q = np.arange(start, end, dtype=np.int64)[:, None]  # [n, 1]
        mask = (assumed[None, :] <= q) & (assumed[None, :] > q - window) & (assumed[None, :] >= 0)
        stale = self._slot_pos[slots][:filled] != assumed
        self.stale_reads += int(np.count_nonzero(mask & stale[None, :]))
        return mask

    def ring_positions(self, layer: int, start: int, n: int) -> np.ndarray:
        """int32 [min(start + n, slots)]: the position each slot holds as :meth:`ring_mask` assumes (-1: none)."""
        slots = self._slots[layer]
        end = start + n
        j = np.arange(min(end, slots), dtype=np.int64)
        assumed = end - 1 - ((end - 1 - j) % slots)
        return np.where(assumed >= 0, assumed, -1).astype(np.int32)

    def is_ring(self, layer: int) -> bool:
        """Whether ``layer`` is a ring now (a sliding layer that wrapped); else laid out as a flat one."""
        return self._ring[layer]

    @property
    def wrapped(self) -> bool:  # a sliding layer became a ring: its rows are this sequence's own
        return any(self._ring)

    def window(self, layer: int) -> int | None:  # None: a flat layer
        spec = self._cfg.layers[layer]
        return spec.window if spec.sliding else None

    def _to_ring(self, layer: int, slots: int) -> None:
        """Lay ``layer``'s committed rows (pieces, then the tail) out as a ring of ``slots`` slots: row p
        at slot p (no position reached ``slots`` yet), a private buffer from now on."""
        rows = self._length - self._tail_start
        parts = [(p.keys[layer], p.values[layer]) for p in self._pieces]
        if rows > 0:
            parts.append((self._keys[layer][:, :rows, :], self._values[layer][:, :rows, :]))
        cfg = self._cfg
        pad = mx.zeros((cfg.kv_heads, slots - self._length, cfg.head_dim), dtype=cfg.dtype)
        self._keys[layer] = mx.concatenate([k for k, _ in parts] + [pad], axis=1)
        self._values[layer] = mx.concatenate([v for _, v in parts] + [pad], axis=1)
        mx.eval(self._keys[layer], self._values[layer])
        self._ring[layer] = True
        self._pieces = tuple(without_layer(p, layer) for p in self._pieces)  # their rows: the ring's now

    def slots(self, layer: int) -> int | None:
        """Physical ring slots of ``layer`` (None on a flat layer)."""
        return self._slots[layer]

    def buffers(self, layer: int) -> tuple[mx.array | None, mx.array | None]:
        """``layer``'s whole (keys, values) buffers, [kv_heads, alloc, head_dim] (tests, diagnostics)."""
        return self._keys[layer], self._values[layer]

    def arrays(self) -> list[mx.array]:
        """Every buffer this sequence writes (to evaluate after a step; the pieces are evaluated)."""
        return [a for a in (*self._keys, *self._values) if a is not None]

    def nbytes(self) -> int:
        """Bytes of this sequence's own buffers and of the pieces it views (shared ones included)."""
        shared = sum(a.nbytes for p in self._pieces for a in (*p.keys, *p.values) if a is not None)
        return shared + sum(a.nbytes for a in self.arrays())

    # ----------------------------------------------------------------- copies
    def seal(self) -> None:
        """Freeze the committed tail rows of the flat layers into a shared piece; later writes go to a
        new tail from ``length`` (the sealed buffers are never written again)."""
        rows = self._length - self._tail_start
        flat = [layer for layer in range(len(self._slots)) if not self._ring[layer]]
        if rows <= 0 or not flat:
            return
        keys = [self._keys[i] if i in flat else None for i in range(len(self._slots))]
        values = [self._values[i] if i in flat else None for i in range(len(self._slots))]
        self._pieces = coalesced((*self._pieces, freeze(self._tail_start, rows, keys, values)))
        for layer in flat:
            self._keys[layer] = self._values[layer] = None
        self._tail_start = self._length

    def copy(self, upto: int) -> SequenceCache | None:
        """A cache of positions ``[0, upto)`` (None when ``can_rewind(upto)`` fails) that shares this one's
        flat rows (both views of one frozen piece: this cache is sealed first) and copies its rings,
        evaluated so the donor's ring buffers stay uniquely owned; it inherits ``written``."""
        if not self.can_rewind(upto):
            return None
        cfg = self._cfg
        if upto > self._tail_start:
            self.seal()
        dup = SequenceCache(cfg)
        dup._length = upto
        dup._written = self._written
        dup._pieces = trim(self._pieces, upto)
        dup._tail_start = upto
        dup._ring = list(self._ring)
        for slots, held in self._slot_pos.items():
            dup._slot_pos[slots] = held.copy()
        pads: dict[int, mx.array] = {}  # one zero block per headroom size, shared by every layer
        for layer, slots in enumerate(self._slots):
            keys, values = self._keys[layer], self._values[layer]
            if keys is None or not self._ring[layer]:
                continue
            if self._written <= slots:
                if upto == 0:
                    continue
                # headroom to the next allocation step, but never more than the prefix itself: a short
                # snapshot should not pay for (or hold) a mostly empty initial_capacity block
                alloc = min(slots, round_up(upto, cfg.initial_capacity), 2 * upto)
                if alloc - upto not in pads:
                    pads[alloc - upto] = mx.zeros((cfg.kv_heads, alloc - upto, cfg.head_dim), dtype=cfg.dtype)
                pad = pads[alloc - upto]
                dup._keys[layer] = mx.concatenate([keys[:, :upto, :], pad], axis=1)
                dup._values[layer] = mx.concatenate([values[:, :upto, :], pad], axis=1)
            else:  # mx.array(a) copies the buffer
                dup._keys[layer] = mx.array(keys)
                dup._values[layer] = mx.array(values)
        mx.eval(dup.arrays())
        return dup
