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
    """Positions ``[0, upto)`` (None when ``can_rewind(upto)`` fails) as evaluated arrays [kv_heads, rows,
    head_dim]: ``upto`` rows flat or unwrapped, all slots of a wrapped ring (the state keeps ``written``);
    views where a layer's rows sit in one buffer, a copy where they sit in shared pieces and a tail."""
    if not cache.can_rewind(upto):
        return None
    arrays = {}
    for name, pieces in _layer_pieces(cache, upto).items():
        arrays[name] = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1)
    mx.eval(list(arrays.values()))
    return SeqState(upto, cache.written, arrays)


def pin_state(cache: SequenceCache) -> PinnedState | None:
    """All committed positions pinned (views, no copy), readable down to the rewind floor on any thread."""
    if not cache.can_rewind(cache.length):
        return None
    positional = {}  # row p holds position p: a flat layer, a ring that never wrapped
    for layer, slots in enumerate(cache._slots):
        flat = slots is None or cache.written <= slots
        positional[f"layers.{layer}.keys"] = positional[f"layers.{layer}.values"] = flat
    arrays = _layer_pieces(cache, cache.length)
    return PinnedState(cache.length, cache.written, cache.rewind_floor, arrays, positional)


def _layer_pieces(cache: SequenceCache, upto: int) -> dict[str, list[mx.array]]:
    """Per array name, views whose rows in order are the exported array's: a flat layer's shared pieces
    (trimmed to ``upto``) then its tail's rows, else one view of the layer's buffer."""
    cfg = cache._cfg
    pieces = trim(cache.pieces, upto)
    out: dict[str, list[mx.array]] = {}
    for layer, slots in enumerate(cache._slots):
        rows = _state_rows(upto, cache.written, slots)
        keys, values = cache._keys[layer], cache._values[layer]
        if not cache.is_ring(layer) and pieces:
            tail = rows - cache.tail_start
            out[f"layers.{layer}.keys"] = [p.keys[layer] for p in pieces] + (
                [keys[:, :tail, :]] if tail > 0 else []
            )
            out[f"layers.{layer}.values"] = [p.values[layer] for p in pieces] + (
                [values[:, :tail, :]] if tail > 0 else []
            )
            continue
        if keys is None or rows == 0:
            keys = values = mx.zeros((cfg.kv_heads, 0, cfg.head_dim), dtype=cfg.dtype)
        out[f"layers.{layer}.keys"] = [keys[:, :rows, :]]
        out[f"layers.{layer}.values"] = [values[:, :rows, :]]
    return out


def state_layout(
    config: CacheConfig, length: int, written: int
) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    """name -> (shape, dtype) of the arrays an exported state of ``length`` / ``written`` holds."""
    layout = {}
    for layer, spec in enumerate(config.layers):
        slots = config.ring_slots(spec.window) if spec.sliding else None
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
            cache._ring[layer] = True
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
