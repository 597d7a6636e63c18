"""One sequence's K/V as a :class:`SeqState` and back (export, pin, layout, restore); a friend of
:class:`SequenceCache` that reads and sets its buffers and marks directly."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine_service.cache.config import CacheConfig
from engine_service.cache.frozen_rows import trim
from engine_service.cache.pinned_state import PinnedState
from engine_service.cache.seq_state import SeqState
from engine_service.cache.sequence_cache import SequenceCache, round_up


def export_state(cache: SequenceCache, upto: int) -> SeqState | None:
    """Positions ``[0, upto)`` (None when ``can_rewind(upto)`` fails) as evaluated views [kv_heads, rows,
    head_dim]: ``upto`` rows flat or unwrapped, all slots of a wrapped ring (the state keeps ``written``)."""
    if not cache.can_rewind(upto):
        return None
    cfg = cache._cfg
    arrays: dict[str, mx.array] = {}
    pieces = trim(cache.pieces, upto)
    for layer, slots in enumerate(cache._slots):
        rows = _state_rows(upto, cache.written, slots)
        keys, values = cache._keys[layer], cache._values[layer]
        if slots is None and pieces:  # the shared pieces, then the tail's rows (a copy)
            tail = max(0, rows - cache.tail_start)
            keys = mx.concatenate(
                [*(p.keys[layer] for p in pieces), *([keys[:, :tail, :]] if tail else [])], axis=1
            )
            values = mx.concatenate(
                [*(p.values[layer] for p in pieces), *([values[:, :tail, :]] if tail else [])], axis=1
            )
        elif keys is None or rows == 0:
            keys = values = mx.zeros((cfg.kv_heads, 0, cfg.head_dim), dtype=cfg.dtype)
        arrays[f"layers.{layer}.keys"] = keys[:, :rows, :]
        arrays[f"layers.{layer}.values"] = values[:, :rows, :]
    mx.eval(list(arrays.values()))
    return SeqState(upto, cache.written, arrays)


def pin_state(cache: SequenceCache) -> PinnedState | None:
    """All committed positions pinned (views; a copy where the flat rows sit in shared pieces), readable
    down to the rewind floor on any thread."""
    state = export_state(cache, cache.length)  # evaluated views of the buffers
    if state is None:
        return None
    positional = {}  # row p holds position p: a flat layer, a ring that never wrapped
    for layer, slots in enumerate(cache._slots):
        flat = slots is None or cache.written <= slots
        positional[f"layers.{layer}.keys"] = positional[f"layers.{layer}.values"] = flat
    return PinnedState(state, cache.rewind_floor, positional)


def state_layout(
    config: CacheConfig, length: int, written: int
) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    """name -> (shape, dtype) of the arrays an exported state of ``length`` / ``written`` holds."""
    layout = {}
    for layer, spec in enumerate(config.layers):
        slots = spec.window + config.max_write - 1 if spec.sliding else None
        shape = (config.kv_heads, _state_rows(length, written, slots), config.head_dim)
        layout[f"layers.{layer}.keys"] = layout[f"layers.{layer}.values"] = (shape, config.dtype)
    return layout


def restore_state(config: CacheConfig, state: SeqState) -> SequenceCache:
    """A cache holding ``state`` exactly (its layout checked by the caller), headroom as a copy gets."""
    cache = SequenceCache(config)
    cache._length, cache._written = state.length, state.written
    for slots, held in cache._slot_pos.items():
        j = np.arange(slots, dtype=np.int64)
        assumed = state.written - 1 - ((state.written - 1 - j) % slots)
        held[:] = np.where(assumed >= 0, assumed, -1)
    for layer, slots in enumerate(cache._slots):
        keys, values = state.arrays[f"layers.{layer}.keys"], state.arrays[f"layers.{layer}.values"]
        rows = keys.shape[1]
        if rows == 0:
            continue
        if slots is not None and state.written > slots:  # a wrapped ring: its slots as they were
            cache._keys[layer], cache._values[layer] = mx.array(keys), mx.array(values)
            continue
        limit = config.capacity if slots is None else slots
        headroom = min(limit, round_up(rows, config.initial_capacity)) - rows
        if headroom == 0:  # the state's arrays become the buffers (MLX copies one before writing if shared)
            cache._keys[layer], cache._values[layer] = keys, values
            continue
        pad = mx.zeros((config.kv_heads, headroom, config.head_dim), dtype=config.dtype)
        cache._keys[layer] = mx.concatenate([keys, pad], axis=1)
        cache._values[layer] = mx.concatenate([values, pad], axis=1)
    mx.eval(cache.arrays())
    return cache


def _state_rows(length: int, written: int, slots: int | None) -> int:
    """Rows an exported layer holds: all slots of a wrapped ring, else the committed positions."""
    return slots if slots is not None and written > slots else length
