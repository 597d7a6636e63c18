"""EntryBook: the stored entries of a :class:`~prefix_service.cache.prefix_cache.PrefixCache` and their
bookkeeping -- the radix index, the budget, the logical clock, the listener -- under one lock."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping

from engine_service.api.errors import InvalidArgument
from prefix_service.cache.budget import Budget
from prefix_service.cache.events import EntryChange, EventKind
from prefix_service.cache.index import TokenIndex
from prefix_service.cache.outcomes import held_positions
from prefix_service.cache.retention import Entry, RetentionPolicy, frozen_metadata
from prefix_service.cache.session_backend import (
    Handle,
    SessionBackend,
    clone_shared_ring_positions,
    clone_shared_share,
    release_handle,
)


class EntryBook:
    """Entries by ``(scope, tokens)``; every method but :meth:`entries` and :meth:`listen` expects the
    lock held. A branch point's recency follows the entries below it (it outlives them)."""

    def __init__(
        self, backend: SessionBackend, policy: RetentionPolicy, max_entries: int, max_positions: int
    ) -> None:
        self._backend = backend
        self._policy = policy
        self._index: TokenIndex[Entry] = TokenIndex()
        self._lock = threading.RLock()
        self._listener: Callable[[EntryChange], None] | None = None
        self._budget = Budget(policy, max_entries, max_positions, self._evicted, self._lock, self._held)
        self._clock = 0
        # the entries whose every layer clones share (keys of at most the engine's ring limit), as a tree
        self._short: TokenIndex[Entry] = TokenIndex()
        self._short_keys = 0
        self._ring_limit = 0

    def _store(self, scope: Hashable, key: tuple[int, ...], snapshot: Handle, metadata: Mapping) -> Entry:
        self._clock += 1
        entry = Entry(scope, key, snapshot, self._clock, self._clock, metadata=frozen_metadata(metadata))
        self._index.insert(scope, key, entry, self._clock)
        self._budget.add(entry)
        self._note_short(entry)
        self._refresh_branches(entry, hit=False)
        self._shade([entry, *self._index.below(scope, key)] if entry.is_branch else [entry])
        return entry

    def entries(self, namespace: str | None = None) -> list[Entry]:
        """Snapshot of the stored entries (all, or one namespace of this engine), oldest first."""
        with self._lock:
            chosen = list(self._budget.entries)
            if namespace is not None:
                scope = self._scope(namespace)
                chosen = [entry for entry in chosen if entry.namespace == scope]
            return sorted(chosen, key=lambda entry: entry.created)

    def listen(self, listener: Callable[[EntryChange], None] | None) -> None:
        """Call ``listener`` on every entry change from now on (None: stop); see the class docstring."""
        with self._lock:
            self._listener = listener

    def _chosen(self, where: Callable[[str], bool]) -> list[Entry]:  # lock held
        return [entry for entry in self._budget.entries if where(entry.namespace[1])]

    def _scope(self, namespace: str) -> Hashable:
        if not isinstance(namespace, str):
            raise InvalidArgument(f"namespace must be a string, got {type(namespace).__name__}")
        return (self._backend.fingerprint, namespace)

    def _refresh(self, entry: Entry) -> None:
        self._clock += 1
        entry.last_used = self._clock
        self._index.touch(entry.namespace, entry.tokens, self._clock)
        self._refresh_branches(entry, hit=False)

    def _refresh_branches(self, entry: Entry, hit: bool) -> None:
        """The branch points above ``entry`` count its use as their own (they outlive their leaves)."""
        for above in self._index.prefixes(entry.namespace, entry.tokens):
            if above.is_branch:
                above.last_used = entry.last_used
                above.subtree_hits += hit
                self._index.touch(above.namespace, above.tokens, entry.last_used)

    def _shade(self, entries: list[Entry]) -> None:
        """Set how much of each entry the deepest branch point above it serves too."""
        for entry in entries:
            depths = [
                a.key_length for a in self._index.prefixes(entry.namespace, entry.tokens) if a.is_branch
            ]
            entry.shadowed = max(depths, default=0)

    def _held(self) -> int:
        """Positions the entries hold: the share of a position clones share counted once per shared prefix
        (the radix tree's edges), the rest once per shared prefix of the short entries (their engine
        shares every layer below its ring limit) and a copy each for the others (every entry's key)."""
        self._sync_ring_limit()
        copied = self._short.edge_positions() + self._budget.key_positions - self._short_keys
        return held_positions(clone_shared_share(self._backend), self._index.edge_positions(), copied)

    def _copied(self, entries: list[Entry]) -> int:
        """:meth:`_held`'s copied positions for ``entries`` (whole namespaces of this cache)."""
        self._sync_ring_limit()
        short = sum(self._short.edge_positions(scope) for scope in {e.namespace for e in entries})
        return short + sum(e.key_length for e in entries if e.key_length > self._ring_limit)

    def _sync_ring_limit(self) -> None:
        limit = clone_shared_ring_positions(self._backend)
        if limit != self._ring_limit:  # the engine said another limit (a restart): regroup the entries
            self._ring_limit = limit
            self._clear_short()
            for entry in self._budget.entries:
                self._note_short(entry)

    def _clear_short(self) -> None:
        self._short.clear()
        self._short_keys = 0

    def _note_short(self, entry: Entry) -> None:
        if entry.key_length <= self._ring_limit:
            self._short.insert(entry.namespace, entry.tokens, entry, entry.last_used)
            self._short_keys += entry.key_length

    def _forget_short(self, entry: Entry) -> None:
        if self._short.remove(entry.namespace, entry.tokens) is not None:
            self._short_keys -= entry.key_length

    def _drop(self, entry: Entry, kind: EventKind) -> None:
        below = self._index.below(entry.namespace, entry.tokens) if entry.is_branch else []
        self._index.remove(entry.namespace, entry.tokens)
        self._forget_short(entry)
        self._shade(below)
        self._budget.discard(entry)
        self._release(entry.snapshot)
        self._emit(kind, entry)

    def _evicted(self, entry: Entry) -> None:
        self._drop(entry, EventKind.EVICTED)

    def _emit(self, kind: EventKind, entry: Entry, source: str = "") -> None:
        listener = self._listener
        if listener is not None:
            listener(EntryChange(kind, entry, source))

    def _release(self, snapshot: Handle) -> None:
        release_handle(self._backend, snapshot)
