"""PrefixCache: stored prompt snapshots (opaque session handles) keyed by ``(engine fingerprint,
namespace, tokens)``, found by shared token prefix, bounded by a retention policy. One lock serializes
the calls; ``lookup`` waits for the engine: never call it from a generation callback."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from functools import partial
from typing import Any

from engine_service.api.errors import FailedPrecondition, InvalidArgument
from prefix_service.cache.admission import admission_refusal
from prefix_service.cache.budget import Reservation
from prefix_service.cache.candidate_walk import Clone, first_within_rewind, walk
from prefix_service.cache.capture import PromptCapture
from prefix_service.cache.entry_book import EntryBook
from prefix_service.cache.events import EventKind
from prefix_service.cache.index import token_key
from prefix_service.cache.outcomes import (
    DUPLICATE,
    INVALID_SNAPSHOT,
    InsertOutcome,
    InsertRefusal,
    LookupOutcome,
    Match,
    MissReason,
    PrefixStats,
)
from prefix_service.cache.retention import (
    BOUNDARY_KEY,
    BRANCH,
    Entry,
    RetentionPolicy,
    frozen_metadata,
    inner_node,
    make_policy,
)
from prefix_service.cache.session_backend import (
    CaptureBackend,
    Handle,
    SessionBackend,
    clone_shared_share,
    clone_with_refusal,
    handle_alive,
    max_rewind,
)
from prefix_service.cache.sharing import DEFAULT_BRANCH_MIN, branch_point, cover_of, covered

DEFAULT_MAX_ATTEMPTS = 16


class PrefixCache(EntryBook):
    """``listen(listener)``: called with an ``events.EntryChange`` (under the lock: it must not block)
    when an entry is stored, moved in, evicted, cleared or dropped (dead, covered: ``cache/events.py``)."""

    def __init__(
        self,
        backend: SessionBackend,
        max_entries: int,
        policy: str | RetentionPolicy = "lru",
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        max_positions: int = 0,
        branch_min: int = DEFAULT_BRANCH_MIN,
    ) -> None:
        """``max_entries`` 0 disables the cache; ``max_positions`` 0: unbounded; ``max_attempts``: the
        clones one lookup tries before it reports a miss; ``branch_min``: shared positions at least
        for a divergence to keep a branch point (0: never; ``sharing.py``)."""
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise InvalidArgument(f"max_attempts must be an int >= 1, got {max_attempts!r}")
        if not isinstance(branch_min, int) or isinstance(branch_min, bool) or branch_min < 0:
            raise InvalidArgument(f"branch_min must be an int >= 0, got {branch_min!r}")
        super().__init__(backend, make_policy(policy), max_entries, max_positions)
        self._max_attempts = max_attempts
        self._branch_min = branch_min
        self._hits = self._misses = self._reused = self._inserts = 0
        self._covered = self._branches = 0
        self._refusals: Counter[str] = Counter()

    @property
    def backend(self) -> SessionBackend:
        return self._backend

    @property
    def policy(self) -> RetentionPolicy:
        return self._policy

    @property
    def max_entries(self) -> int:
        return self._budget.max_entries

    @property
    def max_positions(self) -> int:
        return self._budget.max_positions

    def fill(self) -> float:
        """How full the service's share is: max(entries / max, positions / max); disabled: full."""
        if self.max_entries == 0:
            return 1.0
        positions = self.positions / self.max_positions if self.max_positions else 0.0
        return min(1.0, max(len(self) / self.max_entries, positions))

    @property
    def positions(self) -> int:  # held by the entries
        return self._budget.positions

    def __len__(self) -> int:
        return len(self._budget.entries)

    def lookup(
        self, namespace: str, tokens: Sequence[int], *, count: bool = True, clone: Clone | None = None
    ) -> LookupOutcome:
        """Clone the best stored snapshot for ``tokens`` at ``min(common prefix, len(tokens) - 1)`` (longest
        match, then most recent; a refused clone moves on; a dead entry is dropped), or say why not.
        ``count`` False: counters unchanged; ``clone``: how to clone for this caller (default: the backend's)."""
        key = token_key(tokens)
        scope = self._scope(namespace)
        with self._lock:
            outcome = self._find(scope, key, clone or partial(clone_with_refusal, self._backend))
            if count and outcome.match is None:
                self._misses += 1
            elif count:
                self._hits += 1
                self._reused += outcome.match.reused
            return outcome

    def reusable(self, namespace: str, key: tuple[int, ...]) -> int:
        """Positions a lookup of ``key`` (validated by the caller) would reuse, read from the index without
        cloning or counting (a match below a ring's floor does not count): what a router scores by."""
        found = self.reusable_entry(namespace, key)
        return 0 if found is None else found[1]

    def branch_points(self, namespace: str, tokens: Sequence[int]) -> tuple[int, ...]:
        """Positions inside ``tokens`` where stored prompts of ``namespace`` part (from it, or from each
        other on its path): where a checkpoint is likely to serve a later prompt."""
        with self._lock:
            return tuple(self._index.forks(self._scope(namespace), token_key(tokens)))

    def reusable_entry(self, namespace: str, key: tuple[int, ...]) -> tuple[Entry, int] | None:
        """The entry :meth:`reusable` scores ``key`` by and its reuse (None: none): what a move exports."""
        if len(key) < 2:
            return None
        scope = self._scope(namespace)
        with self._lock:
            if self._budget.max_entries == 0:
                return None
            found = first_within_rewind(self._index.matches(scope, key), len(key), max_rewind(self._backend))
            return None if found is None else (found[0].value, found[1])

    def insert(
        self,
        namespace: str,
        tokens: Sequence[int],
        snapshot: Handle,
        metadata: Mapping[str, Any] | None = None,
        *,
        digest: bytes | None = None,
        reservation: Reservation | None = None,
        moved_from: str = "",
    ) -> InsertOutcome:
        """Store ``snapshot`` (holding exactly ``tokens``: ``admission.py``) or release it; a duplicate
        refreshes the entry; over the bounds the policy evicts. ``reservation`` is always released;
        ``moved_from``: the engine it was copied from. Malformed arguments raise InvalidArgument."""
        with self._lock:
            if reservation is not None:
                reservation.release()
            try:
                scope = self._scope(namespace)
                key = token_key(tokens)
                frozen = frozen_metadata(metadata)
            except InvalidArgument:
                self._release(snapshot)
                raise
            refusal = admission_refusal(self._backend, self._budget, snapshot, key, digest)
            if refusal is not None:
                return self._refuse(snapshot, refusal)
            existing = self._index.get(scope, key)
            if existing is not None:
                if existing.snapshot is snapshot:  # the same handle again: nothing to release
                    self._refresh(existing)
                    self._refusals[DUPLICATE] += 1
                    return InsertOutcome(DUPLICATE)
                if handle_alive(self._backend, existing.snapshot):
                    self._refresh(existing)
                    return self._refuse(snapshot, DUPLICATE)
                self._refusals[INVALID_SNAPSHOT] += 1
                self._drop(existing, EventKind.DROPPED)  # a dead entry is replaced by the live snapshot
            rewind = max_rewind(self._backend)
            plain = key and not inner_node(frozen)  # checkpoints and branch points are kept under it
            longer = cover_of(self._backend, self._index, scope, key, rewind) if plain else None
            if longer is not None:  # a stored answer or longer prompt already serves every position
                self._refresh(longer)
                return self._refuse(snapshot, DUPLICATE)
            branch = branch_point(self._backend, self._index, scope, key, snapshot, self._branch_min, rewind)
            entry = self._store(scope, key, snapshot, frozen)
            self._inserts += 1
            self._emit(EventKind.MOVED if moved_from else EventKind.STORED, entry, moved_from)
            if branch is not None:
                self._branches += 1
                inner = self._store(scope, branch[0], branch[1], {**frozen, BOUNDARY_KEY: BRANCH})
                self._emit(EventKind.STORED, inner)
            for shorter in covered(self._index, scope, key, rewind):
                self._covered += 1
                entry.hits, entry.reused = entry.hits + shorter.hits, entry.reused + shorter.reused
                self._drop(shorter, EventKind.DROPPED)
            stored = entry not in self._budget.evict_while_over()
            return InsertOutcome() if stored else InsertOutcome(InsertRefusal.EVICTED)

    def set_budget(self, max_entries: int, max_positions: int = 0) -> int:
        """New bounds; evicts by the policy until the entries fit them; how many were evicted."""
        with self._lock:
            self._budget.set_bounds(max_entries, max_positions)
            return len(self._budget.evict_while_over())

    def evict(self, n: int = 1) -> int:
        """Evict up to ``n`` entries by the retention policy (a full engine); how many."""
        return self._budget.evict(n)

    def reserve(
        self, namespace: str, tokens: Sequence[int], metadata: Mapping[str, Any] | None = None
    ) -> Reservation | InsertRefusal:
        """Room for the entry ``tokens`` would make (the policy's lower-ranked victims evicted), or why not
        (DUPLICATE: a live entry holds them and is refreshed). Pass it to :meth:`insert` or release it."""
        with self._lock:
            scope, key = self._scope(namespace), token_key(tokens)
            existing = self._index.get(scope, key) if key else None
            frozen = frozen_metadata(metadata)
            if existing is None and key and not inner_node(frozen):
                existing = cover_of(self._backend, self._index, scope, key, max_rewind(self._backend))
            if existing is not None and handle_alive(self._backend, existing.snapshot):
                self._refresh(existing)  # as a duplicate insert would: no room, no snapshot needed
                return InsertRefusal.DUPLICATE
            newcomer = Entry(scope, key or (0,), None, self._clock + 1, self._clock + 1, metadata=frozen)
            return self._budget.reserve(newcomer)

    def capture_prompt(self, session: Handle, prompt: Sequence[int]) -> PromptCapture:
        """A :class:`PromptCapture` of ``session`` at ``len(prompt)`` during its next generation."""
        if not isinstance(self._backend, CaptureBackend):
            raise FailedPrecondition(
                f"{type(self._backend).__name__} cannot queue clones from a generation callback"
            )
        return PromptCapture(self, self._backend, session, prompt)

    def clear(self, where: Callable[[str], bool] | None = None) -> int:
        """Release every stored snapshot (or those of the namespaces ``where`` accepts); how many."""
        with self._lock:
            if where is not None:
                chosen = self._chosen(where)
                for entry in chosen:
                    self._drop(entry, EventKind.CLEARED)
                return len(chosen)
            entries = self._budget.clear()
            self._index.clear()
            self._clear_short()
            for entry in entries:
                self._release(entry.snapshot)
                self._emit(EventKind.CLEARED, entry)
            return len(entries)

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.clear()

    def stats(self, where: Callable[[str], bool] | None = None) -> PrefixStats:
        """The cache's counters; with ``where``, those of the namespaces it accepts (``PrefixStats.of_entries``)."""
        with self._lock:
            if where is not None:
                chosen = self._chosen(where)
                radix = sum(self._index.edge_positions(scope) for scope in {e.namespace for e in chosen})
                sharing, copied = clone_shared_share(self._backend), self._copied(chosen)
                return PrefixStats.of_entries(
                    chosen, self.max_entries, self.max_positions, radix, sharing, copied
                )
            return PrefixStats(
                entries=len(self._budget.entries),
                max_entries=self._budget.max_entries,
                hits=self._hits,
                misses=self._misses,
                reused_tokens=self._reused,
                inserts=self._inserts,
                evictions=self._budget.evictions,
                refusals=dict(self._refusals),
                positions=self._budget.positions,
                max_positions=self._budget.max_positions,
                radix_positions=self._index.edge_positions(),
                covered=self._covered,
                branches=self._branches,
            )

    def record_refusal(self, reason: str) -> None:
        """Count a refusal observed outside the cache's own calls (prompt capture)."""
        with self._lock:
            self._refusals[reason] += 1

    def _find(self, scope: Hashable, key: tuple[int, ...], clone: Clone) -> LookupOutcome:
        """The lookup itself (the caller holds the lock and counts the hit or miss)."""
        if len(key) < 2:
            return LookupOutcome.miss(MissReason.TOO_SHORT)
        if self._budget.max_entries == 0:
            return LookupOutcome.miss(MissReason.DISABLED)
        matches = self._index.matches(scope, key)
        found = walk(self._backend, clone, matches, len(key), self._max_attempts, self._refusals)
        for entry in found.dead:  # removed after the walk: the index must not change while iterating
            self._refusals[INVALID_SNAPSHOT] += 1
            self._drop(entry, EventKind.DROPPED)
        if found.over_quota is not None:
            raise found.over_quota
        if found.hit is not None:
            entry, child, reused = found.hit
            self._refresh(entry)
            entry.hits += 1
            entry.reused += reused
            self._refresh_branches(entry, hit=True)
            return LookupOutcome.hit(Match(child, reused))
        refusal = found.refusal()
        if refusal is not None:
            return LookupOutcome.miss(*refusal)
        if not self._index.holds(scope):
            return LookupOutcome.miss(MissReason.EMPTY)
        return LookupOutcome.miss(MissReason.DIVERGED)  # every live entry differs at the first token

    def _refuse(self, snapshot: Handle, reason: InsertRefusal) -> InsertOutcome:
        self._refusals[reason] += 1
        self._release(snapshot)
        return InsertOutcome(reason)
