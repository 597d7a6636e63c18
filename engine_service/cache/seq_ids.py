"""Sequence ids shared by both cache kinds, and the checks every packed step needs."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine_service.api.errors import CacheError, NotFound
from engine_service.cache.batch_control import Segment
from engine_service.cache.config import CacheConfig


class SeqIdPool:
    """Ids ``0 .. max_seqs - 1``, lowest free first (small, reused: the cache indexes by them)."""

    def __init__(self, max_seqs: int) -> None:
        self._max = max_seqs
        self._live: set[int] = set()

    def acquire(self) -> int | None:
        for sid in range(self._max):
            if sid not in self._live:
                self._live.add(sid)
                return sid
        return None

    def release(self, sid: int) -> None:
        self.check(sid)
        self._live.discard(sid)

    def check(self, sid: object) -> int:
        """``sid`` if it names a live sequence, else NotFound (never a bare KeyError)."""
        if isinstance(sid, bool) or not isinstance(sid, int) or sid not in self._live:
            raise NotFound(f"unknown cache sequence id {sid!r}")
        return int(sid)

    def live(self) -> frozenset[int]:
        return frozenset(self._live)

    def clear(self) -> None:
        self._live.clear()


def check_position(name: str, value: object) -> int:
    """A non-negative int position, else CacheError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CacheError(f"{name} must be an int >= 0, got {value!r}")
    return value


def check_segments(segments: Sequence[Segment], ids: SeqIdPool, pos: dict[int, int]) -> int:
    """The packed row count of a step's segments; NotFound for an unknown sequence, CacheError for an
    empty step, a sequence twice, or a start that is not the sequence's position."""
    if not segments:
        raise CacheError("a packed step needs at least one segment")
    seen: set[int] = set()
    total = 0
    for seg in segments:
        if not isinstance(seg, Segment):
            raise CacheError(f"segments must be Segment, got {type(seg).__name__}")
        ids.check(seg.seq)
        if seg.seq in seen:
            raise CacheError(f"sequence {seg.seq} appears twice in one packed step")
        seen.add(seg.seq)
        if seg.start != pos[seg.seq]:
            raise CacheError(
                f"segment of sequence {seg.seq} starts at {seg.start} but its position is {pos[seg.seq]}"
                " (rewind first to overwrite)"
            )
        total += seg.length
    return total


def check_step_kv(cfg: CacheConfig, layer: int, rows: int, keys: mx.array, values: mx.array) -> None:
    """CacheError unless ``layer`` exists and keys, values are [rows, kv_heads, head_dim]."""
    if not 0 <= layer < len(cfg.layers):
        raise CacheError(f"layer must be in [0, {len(cfg.layers)}), got {layer}")
    expect = (rows, cfg.kv_heads, cfg.head_dim)
    if tuple(keys.shape) != expect or tuple(values.shape) != expect:
        raise CacheError(f"keys/values must be {list(expect)}, got {keys.shape} / {values.shape}")
