"""Shared prefixes stored once: the entries a newly stored one covers (dropped) and the branch point
it makes with a stored entry it diverges from (a snapshot at the divergence, as a radix tree keeps an
inner node). Spec: docs/PREFIX_CACHE.md#shared-prefixes-stored-once."""

from __future__ import annotations

import itertools
from collections.abc import Hashable

from engine_service.api.errors import ForklineError
from prefix_service.cache.index import TokenIndex
from prefix_service.cache.retention import Entry
from prefix_service.cache.session_backend import Handle, SessionBackend, clone_with_refusal, handle_alive

DEFAULT_BRANCH_MIN = 64  # shared positions at least for a divergence to keep a branch point
MAX_SOURCES = 16  # stored entries below a divergence one insert considers cloning the branch point from


def covers(shorter: int, longer: int, rewind: int | None) -> bool:
    """Whether a snapshot of ``longer`` positions serves every position a snapshot of ``shorter`` (a
    prefix of it) did: always where any position can be cloned (``rewind`` None); on a ring, only
    where the longer one's floor is no higher: every reuse >= 1 lies within ``rewind`` of its end."""
    return rewind is None or longer - rewind <= max(1, shorter - rewind)


def covered(
    index: TokenIndex[Entry], scope: Hashable, key: tuple[int, ...], rewind: int | None
) -> list[Entry]:
    """The stored entries under proper prefixes of ``key`` that an entry of ``key`` covers (branch
    points outlive the leaves below them, and checkpoints exist for a ring's floor: both kept)."""
    return [
        entry
        for entry in index.prefixes(scope, key)
        if not entry.is_inner and covers(entry.key_length, len(key), rewind)
    ]


def cover_of(
    backend: SessionBackend,
    index: TokenIndex[Entry],
    scope: Hashable,
    key: tuple[int, ...],
    rewind: int | None,
) -> Entry | None:
    """A live stored entry that ``key`` (not stored) is a proper prefix of and that covers it: storing
    ``key`` would add nothing a lookup could use (None: none)."""
    for match in index.matches(scope, key):
        if match.common < len(key):
            return None  # deepest groups first: the rest share less
        entry = match.value
        longer = entry.key_length > len(key) and covers(len(key), entry.key_length, rewind)
        if longer and handle_alive(backend, entry.snapshot):
            return entry
    return None


def within_reach(length: int, upto: int, rewind: int | None) -> bool:
    """Whether a snapshot of ``length`` positions clones at ``upto`` (``rewind``: a ring's reach)."""
    return rewind is None or length - upto <= rewind


def branch_point(
    backend: SessionBackend,
    index: TokenIndex[Entry],
    scope: Hashable,
    key: tuple[int, ...],
    snapshot: Handle,
    min_shared: int,
    rewind: int | None,
) -> tuple[tuple[int, ...], Handle] | None:
    """Where ``key`` (not stored yet, its ``snapshot`` alive) diverges from the stored keys after at
    least ``min_shared`` shared positions with no entry there: that prefix and a clone at it -- of
    the best-ranked stored entry below it (on a ring, the first of ``MAX_SOURCES`` within reach),
    else of ``snapshot``; None when there is no such divergence or no clone (``min_shared`` 0: never)."""
    if min_shared <= 0:
        return None
    found = index.divergence(scope, key)
    if found is None:
        return None
    depth, at, below = found
    if at is not None or depth < min_shared:
        return None
    reachable = (e for e in itertools.islice(below, MAX_SOURCES) if within_reach(e.key_length, depth, rewind))
    stored = next(reachable, None)
    sources = [(stored.snapshot, stored.key_length)] if stored is not None else []
    for source, length in [*sources, (snapshot, len(key))]:
        if not within_reach(length, depth, rewind) or not handle_alive(backend, source):
            continue
        try:
            child = clone_with_refusal(backend, source, depth).handle
        except ForklineError:  # no room, a stopping engine: the branch point waits for another insert
            return None
        if child is not None:
            return key[:depth], child
    return None
