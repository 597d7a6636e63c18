"""What a prefix-cache call came to: a lookup's :class:`LookupOutcome` (a :class:`Match` or one
:class:`MissReason`), an insert's :class:`InsertOutcome` and the refusal reasons (also the names of
``PrefixStats.refusals``' counters)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any


def held_positions(shared: float, radix_positions: int, copied_positions: int) -> int:
    """Positions a cache's entries hold when clones share ``shared`` (0..1) of a position's bytes: that
    share once per radix-tree position, the rest once per copied position (every entry's key where
    nothing more is shared)."""
    return math.ceil(shared * radix_positions + (1.0 - shared) * copied_positions - 1e-9)


class InsertRefusal(StrEnum):
    """Why an insert stored nothing (the values are the wire names, lower case, and the counters)."""

    DISABLED = "disabled"  # max_entries == 0
    INVALID_KEY = "invalid_key"  # no tokens
    INVALID_SNAPSHOT = "invalid_snapshot"  # closed, or its engine is gone (or cannot say what it holds)
    POSITION_MISMATCH = "position_mismatch"  # the snapshot's position is not len(tokens)
    CONTENT_MISMATCH = "content_mismatch"  # the engine's record of its content is not these tokens
    PREPARED_INPUT = "prepared_input"  # its prefix holds a prepared input: no token key can name it
    CLONE_REFUSED = "clone_refused"  # the engine refused to clone the caller's session (Gateway.insert)
    DUPLICATE = "duplicate"  # an entry with these tokens exists: refreshed, the new snapshot released
    EVICTED = "evicted"  # stored, then chosen at once as the retention policy's victim
    OVER_BUDGET = (
        "over_budget"  # it cannot fit the budget (longer than max_positions, or inserts in flight hold it)
    )


# Refusal reasons counted in PrefixStats.refusals (the insert reasons, and those of clones).
DISABLED = InsertRefusal.DISABLED
INVALID_KEY = InsertRefusal.INVALID_KEY
INVALID_SNAPSHOT = InsertRefusal.INVALID_SNAPSHOT
POSITION_MISMATCH = InsertRefusal.POSITION_MISMATCH
CONTENT_MISMATCH = InsertRefusal.CONTENT_MISMATCH
PREPARED_INPUT = InsertRefusal.PREPARED_INPUT
DUPLICATE = InsertRefusal.DUPLICATE
CLONE_REFUSED = InsertRefusal.CLONE_REFUSED  # also: a lookup's clone of a stored entry was refused
CLONE_ERROR = "clone_error"
CAPTURE_REFUSED = "capture_refused"
OVER_BUDGET = InsertRefusal.OVER_BUDGET
QUOTA = "quota"  # the engine refused a snapshot for this service: its engine budget was full


@dataclass(frozen=True)
class InsertOutcome:
    """An insert's answer: stored (``reason`` None) or refused for ``reason`` (the snapshot released)."""

    reason: InsertRefusal | None = None

    @property
    def stored(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class Match:
    """A lookup hit: ``session`` holds exactly the first ``reused`` request tokens; the caller owns it
    and feeds ``tokens[reused:]`` (at least one token) next."""

    session: Any
    reused: int

    def __post_init__(self) -> None:
        if not isinstance(self.reused, int) or self.reused < 1:
            raise ValueError(f"Match.reused must be a positive int, got {self.reused!r}")


class MissReason(StrEnum):
    """Why a lookup returned no session (the values are the wire names, lower case)."""

    TOO_SHORT = "too_short"  # fewer than two tokens: the final token is always replayed
    DISABLED = "disabled"  # max_entries == 0
    EMPTY = "empty"  # nothing stored under this namespace (and engine)
    DIVERGED = "diverged"  # entries exist, none shares even the first token
    BOUNDARY_REFUSED = "boundary_refused"  # a matching entry exists; the engine refused its clone
    WINDOW = "window"  # matching entries exist, but a sliding-window ring no longer holds their rows there
    ENGINE_RESTARTED = "engine_restarted"  # the gateway dropped every entry; nothing cached since


@dataclass(frozen=True)
class LookupOutcome:
    """One lookup's answer: a ``match``, or no match and the ``reason``. ``diverged_at``: on a hit
    ``match.reused``; on a BOUNDARY_REFUSED or WINDOW miss the refused clone's cut; otherwise 0."""

    match: Match | None
    reason: MissReason | None
    diverged_at: int = 0

    def __post_init__(self) -> None:
        if (self.match is None) == (self.reason is None):
            raise ValueError("LookupOutcome needs exactly one of match and reason")

    @classmethod
    def hit(cls, match: Match) -> LookupOutcome:
        return cls(match, None, match.reused)

    @classmethod
    def miss(cls, reason: MissReason, diverged_at: int = 0) -> LookupOutcome:
        return cls(None, reason, diverged_at)

    @property
    def session(self) -> Any:
        """The matched session, or None on a miss."""
        return None if self.match is None else self.match.session

    @property
    def reused(self) -> int:
        """Positions the match holds; 0 on a miss."""
        return 0 if self.match is None else self.match.reused


@dataclass(frozen=True)
class PrefixStats:
    """Counters since creation (``clear`` keeps them). reused_tokens sums ``Match.reused`` over hits.
    positions: held by the entries (a shared prefix once where clones share storage, else a copy
    per entry); max_positions: their bound (0: unbounded); bytes_held, max_bytes: the same at the
    engine's bytes per position (0: not known, :meth:`in_bytes` sets them); radix_positions: what an
    ideal radix tree of the same keys holds; covered: entries dropped as covered by a longer one;
    branches: branch points stored (``sharing.py``)."""

    entries: int
    max_entries: int
    hits: int
    misses: int
    reused_tokens: int
    inserts: int
    evictions: int
    refusals: dict[str, int] = field(default_factory=dict)  # a fresh copy per stats() call
    positions: int = 0
    max_positions: int = 0
    radix_positions: int = 0
    covered: int = 0
    branches: int = 0
    bytes_held: int = 0
    max_bytes: int = 0

    def in_bytes(self, bytes_per_position: int) -> PrefixStats:
        """These stats with bytes_held and max_bytes at ``bytes_per_position`` (0: unknown, left 0)."""
        return replace(
            self,
            bytes_held=self.positions * bytes_per_position,
            max_bytes=self.max_positions * bytes_per_position,
        )

    @classmethod
    def of_entries(
        cls,
        entries: Sequence[Any],
        max_entries: int,
        max_positions: int,
        radix_positions: int = 0,
        shared: float = 0.0,
        copied: int | None = None,
    ) -> PrefixStats:
        """One caller's entries' stats (``retention.Entry``): the hits they served and the positions
        those reused and hold (``radix_positions``: their tree's; ``shared``: the share of a position
        clones share; ``copied``: the positions holding the rest, default every key's,
        :func:`held_positions`); the cache-wide counters are 0."""
        keys = sum(entry.key_length for entry in entries)
        return cls(
            entries=len(entries),
            max_entries=max_entries,
            hits=sum(entry.hits for entry in entries),
            misses=0,
            reused_tokens=sum(entry.reused for entry in entries),
            inserts=0,
            evictions=0,
            positions=held_positions(shared, radix_positions, keys if copied is None else copied),
            max_positions=max_positions,
            radix_positions=radix_positions,
        )
