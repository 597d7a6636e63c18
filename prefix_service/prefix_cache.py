"""PrefixCache: stored prompt snapshots (opaque session handles) found by shared token prefix.

Contracts (DESIGN.md section 4):

- ``lookup_outcome(namespace, tokens) -> LookupOutcome`` clones a stored snapshot at
  ``reused = min(common prefix, len - 1)`` (the final token is always replayed so the caller gets
  logits) and hands the clone to the caller, who owns it. Candidates go longest match first, then most
  recently used; a refused clone moves to the next candidate (a token match never proves K/V
  residency: the clone decides); a hit refreshes recency. An entry whose snapshot the backend no longer
  knows (``valid`` False, or the clone raises NotFound, e.g. an engine handle that expired) is dropped.
  A miss says why (``outcomes.MissReason``), decided by this lookup alone under the cache's lock:
  TOO_SHORT (empty and one-token requests), DISABLED, BOUNDARY_REFUSED (a matching entry's clone was
  refused or failed), EMPTY (nothing stored under the namespace), DIVERGED (entries exist, none shares
  the first token). ``lookup(namespace, tokens)`` is the same call answering ``Match | None``.
- ``insert(namespace, tokens, snapshot, metadata)`` takes ownership of ``snapshot``: it is stored or
  released, never leaked. Refused (and released): disabled cache (``max_entries == 0``), empty key,
  invalid (closed or dead) snapshot, ``position(snapshot) != len(tokens)``, a snapshot that does not
  hold ``tokens`` (``CONTENT_MISMATCH``: the backend's ``content_digest`` -- the engine's record of what
  the session holds -- differs from ``content.content_digest(tokens)``; ``PREPARED_INPUT``: its prefix
  holds a prepared input, which no token key can name), duplicate key (the existing entry is
  refreshed instead). Over ``max_entries`` the retention policy picks the victim, whose snapshot is
  released. ``insert_outcome`` says which (:class:`InsertOutcome`). The tokens are hashed once per
  insert (not at all when the caller passes their digest), never per lookup.
- Keys are ``(engine fingerprint, namespace, tokens)``: the backend's fingerprint (weights, tokenizer,
  cache kind, kv dtype, window geometry, weights dtype) is part of every key, so a snapshot is never
  reused across models or execution configurations.

Threading: calls are serialized by an internal lock. ``lookup`` and ``collect`` wait for the engine,
so never call them from a generation callback (the engine thread would wait on itself).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from engine_service.content import content_digest
from engine_service.errors import FailedPrecondition, ForklineError, InvalidArgument, NotFound
from prefix_service.backends import CaptureBackend, Handle, SessionBackend, handle_alive, release_handle
from prefix_service.capture import PromptCapture
from prefix_service.index import TokenIndex, token_key
from prefix_service.outcomes import (
    CLONE_ERROR,
    CLONE_REFUSED,
    CONTENT_MISMATCH,
    DISABLED,
    DUPLICATE,
    INVALID_KEY,
    INVALID_SNAPSHOT,
    POSITION_MISMATCH,
    PREPARED_INPUT,
    InsertOutcome,
    InsertRefusal,
    LookupOutcome,
    Match,
    MissReason,
)
from prefix_service.retention import NO_METADATA, Entry, RetentionPolicy, make_policy

DEFAULT_MAX_ATTEMPTS = 16

_GONE = object()  # _clone's answer when the backend no longer knows the snapshot at all


@dataclass(frozen=True)
class PrefixStats:
    """Counters since creation (``clear`` keeps them). reused_tokens sums ``Match.reused`` over hits."""

    entries: int
    max_entries: int
    hits: int
    misses: int
    reused_tokens: int
    inserts: int
    evictions: int
    refusals: dict[str, int] = field(default_factory=dict)  # a fresh copy per stats() call


def _frozen_metadata(metadata: Mapping[str, Any] | None) -> Mapping[str, str]:
    if metadata is None:
        return NO_METADATA
    if not isinstance(metadata, Mapping):
        raise InvalidArgument(f"metadata must be a mapping of strings, got {type(metadata).__name__}")
    for name in metadata:
        if not isinstance(name, str):
            raise InvalidArgument(f"metadata keys must be strings, got {name!r}")
    return MappingProxyType({name: str(value) for name, value in metadata.items()}) if metadata else NO_METADATA


class PrefixCache:
    """Bounded store of prompt snapshots over a :class:`SessionBackend`; see the module docstring."""

    def __init__(
        self,
        backend: SessionBackend,
        max_entries: int,
        policy: str | RetentionPolicy = "lru",
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> None:
        """``max_entries == 0`` disables the cache (every insert is released, every lookup misses).
        ``max_attempts`` bounds the clones one lookup tries before it reports a miss."""
        if not isinstance(max_entries, int) or max_entries < 0:
            raise InvalidArgument(f"max_entries must be an int >= 0, got {max_entries!r}")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise InvalidArgument(f"max_attempts must be an int >= 1, got {max_attempts!r}")
        self._backend = backend
        self._max_entries = max_entries
        self._max_attempts = max_attempts
        self._policy = make_policy(policy)
        self._index: TokenIndex[Entry] = TokenIndex()
        self._entries: set[Entry] = set()
        self._lock = threading.RLock()
        self._clock = 0
        self._hits = self._misses = self._reused = self._inserts = self._evictions = 0
        self._refusals: Counter[str] = Counter()

    # -- properties --------------------------------------------------------------------------

    @property
    def backend(self) -> SessionBackend:
        return self._backend

    @property
    def policy(self) -> RetentionPolicy:
        return self._policy

    @property
    def max_entries(self) -> int:
        return self._max_entries

    @property
    def size(self) -> int:
        return len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    # -- operations --------------------------------------------------------------------------

    def lookup(self, namespace: str, tokens: Sequence[int]) -> Match | None:
        """Clone the best stored snapshot for ``tokens``; None on a miss. See the module docstring."""
        return self.lookup_outcome(namespace, tokens).match

    def lookup_outcome(self, namespace: str, tokens: Sequence[int]) -> LookupOutcome:
        """Like :meth:`lookup`, and a miss says why (see the module docstring)."""
        key = token_key(tokens)
        scope = self._scope(namespace)
        with self._lock:
            outcome = self._find(scope, key)
            if outcome.match is None:
                self._misses += 1
            else:
                self._hits += 1
                self._reused += outcome.match.reused
            return outcome

    def insert(self, namespace: str, tokens: Sequence[int], snapshot: Handle,
               metadata: Mapping[str, Any] | None = None, *, digest: bytes | None = None) -> bool:
        """Store ``snapshot`` (holding exactly ``tokens``) or release it; True when it was stored.
        See :meth:`insert_outcome`."""
        return self.insert_outcome(namespace, tokens, snapshot, metadata, digest=digest).stored

    def insert_outcome(
        self,
        namespace: str,
        tokens: Sequence[int],
        snapshot: Handle,
        metadata: Mapping[str, Any] | None = None,
        *,
        digest: bytes | None = None,
    ) -> InsertOutcome:
        """Like :meth:`insert`, and a refusal says why (see the module docstring).

        ``digest``: ``content.content_digest(tokens)`` when the caller already computed it (so the
        tokens are hashed once per insert); it must be the digest of these very tokens.
        Malformed arguments (non-int tokens, ids outside [0, 2**64), non-string namespace or
        metadata keys) release the snapshot and raise InvalidArgument.
        """
        with self._lock:
            try:
                scope = self._scope(namespace)
                key = token_key(tokens)
                frozen = _frozen_metadata(metadata)
            except InvalidArgument:
                self._release(snapshot)
                raise
            if self._max_entries == 0:
                return self._refuse(snapshot, DISABLED)
            if not key:
                return self._refuse(snapshot, INVALID_KEY)
            if not handle_alive(self._backend, snapshot):
                return self._refuse(snapshot, INVALID_SNAPSHOT)
            if self._position(snapshot) != len(key):
                return self._refuse(snapshot, POSITION_MISMATCH)
            refusal = self._content_refusal(snapshot, key, digest)
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
                self._drop(existing)  # a dead entry is replaced by the live snapshot
            self._clock += 1
            entry = Entry(scope, key, snapshot, created=self._clock, last_used=self._clock, metadata=frozen)
            self._index.insert(scope, key, entry, self._clock)
            self._entries.add(entry)
            self._inserts += 1
            stored = True
            while len(self._entries) > self._max_entries:
                victim = min(self._entries, key=self._policy.priority)
                stored = stored and victim is not entry
                self._evictions += 1
                self._drop(victim)
            return InsertOutcome() if stored else InsertOutcome(InsertRefusal.EVICTED)

    def capture_prompt(self, session: Handle, prompt: Sequence[int]) -> PromptCapture:
        """A :class:`PromptCapture` snapshotting ``session`` at ``len(prompt)`` (and at prefill
        breakpoints) during its next generation. Needs a backend with ``clone_async``."""
        if not isinstance(self._backend, CaptureBackend):
            raise FailedPrecondition(
                f"{type(self._backend).__name__} cannot queue clones from a generation callback"
            )
        return PromptCapture(self, self._backend, session, prompt)

    def clear(self) -> int:
        """Release every stored snapshot (only those the cache owns); returns how many."""
        with self._lock:
            entries = list(self._entries)
            self._index.clear()
            self._entries.clear()
            for entry in entries:
                self._release(entry.snapshot)
            return len(entries)

    close = clear

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.clear()

    def stats(self) -> PrefixStats:
        with self._lock:
            return PrefixStats(
                entries=len(self._entries),
                max_entries=self._max_entries,
                hits=self._hits,
                misses=self._misses,
                reused_tokens=self._reused,
                inserts=self._inserts,
                evictions=self._evictions,
                refusals=dict(self._refusals),
            )

    def entries(self, namespace: str | None = None) -> list[Entry]:
        """Snapshot of the stored entries (all, or one namespace of this engine), oldest first."""
        with self._lock:
            chosen = list(self._entries)
            if namespace is not None:
                scope = self._scope(namespace)
                chosen = [entry for entry in chosen if entry.namespace == scope]
            return sorted(chosen, key=lambda entry: entry.created)

    def record_refusal(self, reason: str) -> None:
        """Count a refusal observed outside the cache's own calls (prompt capture)."""
        with self._lock:
            self._refusals[reason] += 1

    # -- internals ---------------------------------------------------------------------------

    def _find(self, scope: Hashable, key: tuple[int, ...]) -> LookupOutcome:
        """The lookup itself (the caller holds the lock and counts the hit or miss)."""
        if len(key) < 2:
            return LookupOutcome.miss(MissReason.TOO_SHORT)
        if self._max_entries == 0:
            return LookupOutcome.miss(MissReason.DISABLED)
        dead: list[Entry] = []
        hit: Match | None = None
        refused_at = 0  # the longest common prefix whose clone was refused (0: none was)
        attempts = 0
        for candidate in self._index.matches(scope, key):
            entry = candidate.value
            if not handle_alive(self._backend, entry.snapshot):
                dead.append(entry)  # its engine is gone: no clone call
                continue
            reused = min(candidate.common, len(key) - 1)
            child = self._clone(entry.snapshot, reused)
            if child is _GONE:  # e.g. the engine expired the handle: it can never serve again
                dead.append(entry)
                continue
            if child is not None:
                self._refresh(entry)
                entry.hits += 1
                hit = Match(child, reused)
                break
            refused_at = max(refused_at, candidate.common)
            attempts += 1
            if attempts >= self._max_attempts:
                break
        for entry in dead:  # removed after the walk: the index must not change while iterating
            self._refusals[INVALID_SNAPSHOT] += 1
            self._drop(entry)
        if hit is not None:
            return LookupOutcome.hit(hit)
        if refused_at:
            return LookupOutcome.miss(MissReason.BOUNDARY_REFUSED, refused_at)
        if not self._index.holds(scope):
            return LookupOutcome.miss(MissReason.EMPTY)
        return LookupOutcome.miss(MissReason.DIVERGED)  # every live entry differs at the first token

    def _scope(self, namespace: str) -> Hashable:
        if not isinstance(namespace, str):
            raise InvalidArgument(f"namespace must be a string, got {type(namespace).__name__}")
        return (self._backend.fingerprint, namespace)

    def _refresh(self, entry: Entry) -> None:
        self._clock += 1
        entry.last_used = self._clock
        self._index.touch(entry.namespace, entry.tokens, self._clock)

    def _drop(self, entry: Entry) -> None:
        self._index.remove(entry.namespace, entry.tokens)
        self._entries.discard(entry)
        self._release(entry.snapshot)

    def _refuse(self, snapshot: Handle, reason: InsertRefusal) -> InsertOutcome:
        self._refusals[reason] += 1
        self._release(snapshot)
        return InsertOutcome(reason)

    def _content_refusal(self, snapshot: Handle, key: tuple[int, ...], digest: bytes | None) -> InsertRefusal | None:
        """Why ``snapshot`` does not hold exactly ``key`` per the backend (the engine's record), or None."""
        try:
            held = self._backend.content_digest(snapshot)
        except ForklineError:
            return INVALID_SNAPSHOT  # it cannot say what it holds: never stored unverified
        if held is None:
            return PREPARED_INPUT
        if digest is None:
            try:
                digest = content_digest(key)
            except InvalidArgument:
                return CONTENT_MISMATCH  # ids past int32 are no session's content
        return None if held == digest else CONTENT_MISMATCH

    # Backend calls: an engine-side failure (ForklineError, e.g. the engine stopped) is a refusal.

    def _clone(self, snapshot: Handle, upto: int) -> Any:
        """The clone, None when refused, or ``_GONE`` when the backend does not know the snapshot
        (NotFound: a permanent condition, unlike a refusal or a transient failure)."""
        try:
            child = self._backend.clone(snapshot, upto)
        except NotFound:
            return _GONE
        except ForklineError:
            self._refusals[CLONE_ERROR] += 1
            return None
        if child is None:
            self._refusals[CLONE_REFUSED] += 1
        return child

    def _position(self, snapshot: Handle) -> int | None:
        try:
            return self._backend.position(snapshot)
        except ForklineError:
            return None

    def _release(self, snapshot: Handle) -> None:
        release_handle(self._backend, snapshot)
