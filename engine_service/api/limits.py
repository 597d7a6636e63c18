"""The engine's input rules, one owner each (vocabulary, empty input, fitting the session,
breakpoints), called once by the doors; every message names its field."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_service.api.checks import checked_int
from engine_service.api.errors import InvalidArgument


@dataclass(frozen=True)
class EngineLimits:
    """What one engine admits: resident sessions, positions per session, token ids; the positions its
    K/V holds in all and the bytes one position of one session costs (0: not reported)."""

    max_sessions: int
    max_session_tokens: int
    vocab_size: int
    max_positions: int = 0
    kv_bytes_per_position: int = 0
    # of those bytes, what a clone shares with its source instead of copying (all on batched-cell, the
    # flat layers' on batched-sequence; 0: a whole copy, or not reported)
    clone_shared_bytes_per_position: int = 0
    # a clone of a session that never wrote past this many positions shares every layer's bytes (a
    # batched-sequence sliding layer laid out flat until it wraps; 0: never)
    clone_shared_ring_positions: int = 0

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_session_tokens", "vocab_size"):
            checked_int(name, getattr(self, name), lo=1)
        for name in ("max_positions", "kv_bytes_per_position", "clone_shared_ring_positions"):
            checked_int(name, getattr(self, name), lo=0)
        checked_int(
            "clone_shared_bytes_per_position",
            self.clone_shared_bytes_per_position,
            lo=0,
            hi=self.kv_bytes_per_position,
        )


def out_of_vocab(tokens: Sequence[int], vocab_size: int) -> int | None:
    """Index of the first id outside ``[0, vocab_size)``, or None (two C-level passes when all are valid)."""
    if not tokens or (min(tokens) >= 0 and max(tokens) < vocab_size):
        return None
    return next(i for i, t in enumerate(tokens) if not 0 <= t < vocab_size)


def check_tokens(ids: Sequence[int], vocab_size: int, field: str = "tokens") -> list[int]:
    """``ids`` as a list, every one inside the vocabulary; InvalidArgument naming ``field[i]`` otherwise."""
    out = list(ids)
    bad = out_of_vocab(out, vocab_size)
    if bad is not None:
        raise InvalidArgument(f"{field}[{bad}] = {out[bad]} is outside the vocabulary [0, {vocab_size})")
    return out


def check_nonempty(size: int, field: str = "input") -> None:
    """An input of no positions is refused: there would be nothing to predict from."""
    if size <= 0:
        raise InvalidArgument(f"{field} is empty")


def check_fits(start: int, size: int, max_session_tokens: int, field: str = "input") -> None:
    """``size`` positions written from ``start`` must fit a session of ``max_session_tokens``."""
    if start + size > max_session_tokens:
        raise InvalidArgument(
            f"{field} of {size} positions at position {start} exceeds max_session_tokens={max_session_tokens}"
        )


def check_breakpoints(
    start: int, size: int, breakpoints: Sequence[int], field: str = "capture.breakpoints"
) -> None:
    """Breakpoints must lie inside the input's positions ``(start, start + size]``."""
    for b in breakpoints:
        if not start < b <= start + size:
            raise InvalidArgument(f"{field}: {b} is outside the input's positions ({start}, {start + size}]")
