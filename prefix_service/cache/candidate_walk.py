"""The candidates of one lookup: which stored snapshot the engine clones for a request (longest common
prefix first, then most recent; on a ring that evicts window rows, candidates past ``max_rewind`` are
passed over without a clone call)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine_service.api.answers import CloneRefusal, TakenClone
from engine_service.api.errors import ForklineError, NotFound, QuotaExceeded
from prefix_service.cache.index import IndexMatch
from prefix_service.cache.outcomes import CLONE_ERROR, CLONE_REFUSED, MissReason
from prefix_service.cache.retention import Entry
from prefix_service.cache.session_backend import (
    Handle,
    SessionBackend,
    handle_alive,
    max_rewind,
)

Clone = Callable[[Handle, int], TakenClone]  # a lookup's clone: the handle, upto -> the clone or the refusal

MAX_WINDOW_SKIPS = 1024  # candidates one walk passes over without a clone call (below a ring's floor)


def _beyond_rewind(entry: Entry, reused: int, rewind: int | None) -> bool:
    return rewind is not None and len(entry.tokens) - reused > rewind


def first_within_rewind(
    matches: Iterable[IndexMatch[Entry]], request_length: int, rewind: int | None
) -> tuple[IndexMatch[Entry], int] | None:
    """The first match a clone could reach (``rewind``: ``session_backend.max_rewind``, None: every
    one) and the positions it would reuse; None when none does."""
    for seen, candidate in enumerate(matches):
        reused = min(candidate.common, request_length - 1)
        if not _beyond_rewind(candidate.value, reused, rewind):
            return candidate, reused
        if seen >= MAX_WINDOW_SKIPS:
            break
    return None


@dataclass
class Walk:
    """What one walk came to: a hit, or why not."""

    hit: tuple[Entry, Handle, int] | None = None  # the entry, the clone the caller owns, its positions
    dead: list[Entry] = field(default_factory=list)  # entries to drop
    refused_at: int = 0  # the longest common prefix whose clone was refused
    window_at: int = 0  # ... because a ring no longer holds the rows there (or passed over for it)
    other_refusal: bool = False  # some refusal was for another reason (e.g. room)
    over_quota: QuotaExceeded | None = None  # the receiver's quota ended the walk

    def refusal(self) -> tuple[MissReason, int] | None:
        """The miss a refusal explains (WINDOW when only rings refused), and where; None otherwise."""
        if self.window_at and not self.other_refusal:
            return MissReason.WINDOW, self.window_at
        if self.refused_at:
            return MissReason.BOUNDARY_REFUSED, self.refused_at
        return None


def walk(
    backend: SessionBackend,
    clone: Clone,
    matches: Iterable[IndexMatch[Entry]],
    request_length: int,
    max_attempts: int,
    refusals: Counter[str],
) -> Walk:
    """Clone candidates in turn until one succeeds (a refusal moves on, at most ``max_attempts``; a dead
    entry is set aside); changes nothing of the cache. ``refusals`` counts the clones refused."""
    found = Walk()
    attempts = skipped = 0
    rewind = max_rewind(backend)
    for candidate in matches:
        entry = candidate.value
        reused = min(candidate.common, request_length - 1)
        if _beyond_rewind(entry, reused, rewind):  # below a ring's floor: the engine would refuse
            found.window_at = max(found.window_at, candidate.common)
            skipped += 1
            if skipped >= MAX_WINDOW_SKIPS:
                break
            continue
        if not handle_alive(backend, entry.snapshot):
            found.dead.append(entry)  # its engine is gone: no clone call
            continue
        child = _clone(clone, entry.snapshot, reused, refusals)
        if child is _GONE:  # e.g. the engine expired the handle: it can never serve again
            found.dead.append(entry)
            continue
        if isinstance(child, QuotaExceeded):  # the receiver has no room: no other entry would help
            found.over_quota = child
            break
        if isinstance(child, _Refused):
            found.refused_at = max(found.refused_at, candidate.common)
            if child.window:
                found.window_at = max(found.window_at, candidate.common)
            else:
                found.other_refusal = True
            attempts += 1
            if attempts >= max_attempts:
                break
            continue
        found.hit = (entry, child, reused)
        break
    return found


_GONE = object()  # _clone's answer when the backend no longer knows the snapshot at all


class _Refused:
    """_clone's answer when the engine refused; ``window``: because a ring no longer holds the rows."""

    __slots__ = ("window",)

    def __init__(self, window: bool) -> None:
        self.window = window


def _clone(clone: Clone, snapshot: Handle, upto: int, refusals: Counter[str]) -> Any:
    """The clone, a :class:`_Refused` (an engine-side failure is one too), the receiver's
    QuotaExceeded, or ``_GONE`` when the backend does not know the snapshot (NotFound: permanent)."""
    try:
        taken = clone(snapshot, upto)
    except NotFound:
        return _GONE
    except QuotaExceeded as exc:  # the receiver's quota
        return exc
    except ForklineError:
        refusals[CLONE_ERROR] += 1
        return _Refused(window=False)
    if taken.handle is None:
        refusals[CLONE_REFUSED] += 1
        return _Refused(window=taken.refusal == CloneRefusal.WINDOW)
    return taken.handle
