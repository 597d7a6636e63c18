"""Moving a stored snapshot to another engine instead of recomputing its prompt there.

When the route's first engine is not the one holding the request's prefix (that one is loaded or
draining) and moving is cheaper than prefilling (``cost_model.py``), :meth:`SnapshotMover.move`
copies the holder's stored entry to the first engine before the request is served there:

1. the holder's entry that scores the prompt (``PrefixCache.reusable_entry``) -- gone: no move. What
   moves is the entry when the request reuses all of it (or all but its last token), else only the
   prefix it reuses: ``ExportSession`` with ``upto`` exports just those positions (so a shared header
   moves as a header, not as another tenant's whole prompt), from a draining holder too (it answers
   exports). A stored snapshot is pinned on a ``batched-sequence`` engine (``Info.pinned_exports``):
   its export, whole or a prefix, is copied on the engine's RPC thread without waiting for the
   forward its engine thread is running, so a busy holder moves as fast as an idle one;
2. its exact length checked once more: ``rates.move_s(positions moved) < s_pos * (reused there -
   reused here)``, or no move (``slower``): a move never costs more than the recompute it saves;
3. ``ExportSession`` on the holder streamed, chunk by chunk, into ``ImportSession`` on the target:
   the bytes pass through this service (engines never call each other: no engine-to-engine
   addresses, credentials or trust; this service already holds a persistent owner's token on both,
   and one more hop on the same network costs less than a millisecond per MiB here). The target
   engine checks the file as any load (format, checksum, signature with ``--snapshot_key``, content,
   fingerprint, geometry) and reports the content digest of what it loaded;
4. the new session is inserted into the target's cache (room reserved there before the export: the
   retention policy evicts what ranks below it first, as for any insert) under the entry's namespace, tokens and
   metadata: the cache verifies the digest against the tokens as for any insert, and its listener
   hears ``MOVED`` (``cache/events.py``). The original stays on the holder.

A move that does not happen says why (:class:`MoveOutcome`); the request then computes what the target
lacks, exactly as without moves. Concurrent requests for the same prefix and target share one move
(the later ones wait for it). Each finished move's seconds feed the fleet's rates
(``rates.RateMeter.observe_move``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine_service.api.errors import ForklineError
from prefix_service.cache.budget import Reservation
from prefix_service.cache.retention import Entry
from prefix_service.fleet.member import EngineMember
from prefix_service.fleet.rates import RateMeter
from prefix_service.tier.persistent_tier import PersistentTier, Restored
from prefix_service.tier.snapshot_backend import SnapshotBackend
from prefix_service.tier.snapshot_store import extra_for

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0  # how long a request waits for the same move another request is making


@dataclass(frozen=True)
class MoveOutcome:
    """``moved``: the target now holds a copy of ``positions`` positions (it took ``seconds``);
    otherwise ``refusal`` says why not: ``gone`` (the holder no longer has it), ``slower``,
    ``unsupported`` (an engine without snapshot files), ``export`` (the holder refused, e.g. a
    prefix below a sliding-window ring's floor), ``directory`` (a restore from the
    snapshot directory did not store the file), ``import:<reason>`` (the target
    refused the file), ``insert:<reason>`` (the target's cache did
    not store it), ``joined`` (another request's move of it ended first), or an error's type name."""

    moved: bool
    positions: int = 0
    seconds: float = 0.0
    refusal: str = ""


class SnapshotMover:
    """See the module docstring. ``clock``: seconds (monotonic), for the measurement."""

    def __init__(self, rates: RateMeter, clock: Callable[[], float] = time.perf_counter) -> None:
        self.rates, self._clock = rates, clock
        self._lock = threading.Lock()
        self._moving: dict[tuple[str, str, tuple[int, ...]], threading.Event] = {}

    def move(
        self,
        holder: EngineMember,
        target: EngineMember,
        namespace: str,
        key: tuple[int, ...],
        reused_there: int,
    ) -> MoveOutcome:
        """Copy what ``holder`` holds of ``key`` (under ``namespace``) into ``target``, whose own cache
        reuses ``reused_there`` positions of it; see the module docstring. Never raises for the
        engines' failures: they are a refusal (the request recomputes)."""
        found = holder.gateway.cache.reusable_entry(namespace, key)
        if found is None:
            return self._refused(holder, target, "gone")
        entry, reused = found
        # the entry itself when the request reuses (nearly) all of it, else the prefix it reuses
        tokens = entry.tokens if reused >= entry.key_length - 1 else entry.tokens[:reused]
        rates = self.rates.rates()
        if rates.move_s(len(tokens)) >= rates.prefill_s_per_position * (reused - reused_there):
            return self._refused(holder, target, "slower")
        if not isinstance(holder.gateway.backend, SnapshotBackend) or not isinstance(
            target.gateway.backend, SnapshotBackend
        ):
            return self._refused(holder, target, "unsupported")
        with self._turn((target.name, namespace, tokens)) as first:
            if not first:
                return self._refused(holder, target, "joined")
            room = target.gateway.cache.reserve(namespace, tokens, entry.metadata)  # evicts first
            if not isinstance(room, Reservation):
                return self._refused(holder, target, f"insert:{room}")
            return self._copy(holder, target, namespace, entry, tokens, room)

    @contextlib.contextmanager
    def _turn(self, ticket: tuple[str, str, tuple[int, ...]]) -> Iterator[bool]:
        """Whether this request makes the copy of ``ticket`` (target, namespace, tokens): True for the
        first, which the others wait for (up to JOIN_TIMEOUT_S) and then get False (``joined``)."""
        with self._lock:
            running = self._moving.get(ticket)
            if running is None:
                self._moving[ticket] = threading.Event()
        if running is not None:
            running.wait(JOIN_TIMEOUT_S)
            yield False
            return
        try:
            yield True
        finally:
            with self._lock:
                self._moving.pop(ticket).set()

    def _copy(
        self,
        holder: EngineMember,
        target: EngineMember,
        namespace: str,
        entry: Entry,
        tokens: tuple[int, ...],
        room: Reservation,
    ) -> MoveOutcome:
        """Export ``tokens`` (the entry, or its first ``len(tokens)`` positions), import and insert
        them (``room``: the target cache's reservation, always consumed)."""
        started, source = self._clock(), holder.gateway.backend
        upto = None if len(tokens) >= entry.key_length else len(tokens)
        try:
            chunks = source.export_session(entry.snapshot, extra_for(namespace, tokens, entry.metadata), upto)
            imported = None if chunks is None else target.gateway.backend.import_session(chunks)
        except ForklineError as exc:
            room.release()
            log.info("move %s -> %s failed: %s", holder.name, target.name, exc)
            return self._refused(holder, target, type(exc).__name__)
        if imported is None or imported.handle is None:
            room.release()
            return self._refused(
                holder, target, "export" if imported is None else f"import:{imported.refusal}"
            )
        outcome = target.gateway.cache.insert(
            namespace, tokens, imported.handle, entry.metadata, moved_from=holder.name, reservation=room
        )
        if not outcome.stored:
            return self._refused(holder, target, f"insert:{outcome.reason}")
        seconds = self._clock() - started
        self.rates.observe_move(len(tokens), seconds)
        holder.moved_out()
        target.moved_in()
        log.info(
            "moved %d positions %s -> %s in %.1f ms", len(tokens), holder.name, target.name, seconds * 1e3
        )
        return MoveOutcome(True, len(tokens), seconds)

    def restore(
        self,
        tier: PersistentTier,
        target: EngineMember,
        namespace: str,
        key: tuple[int, ...],
        positions: int,
    ) -> MoveOutcome:
        """A move from the snapshot directory: its longest stored prefix of ``key`` (``positions``
        long, as routing read it) restored into ``target`` (the gateway's lookup would restore it too;
        made here to be measured as a move). Concurrent restores of that prefix into ``target`` share
        one (as moves do: the later ones wait, ``joined``); refused as ``directory`` when the
        folder's file is gone or the engine or the cache refused it."""
        with self._turn((target.name, namespace, tuple(key[:positions]))) as first:
            if not first:
                target.move_refused("joined")
                return MoveOutcome(False, refusal="joined")
            started, done = self._clock(), Restored()
            restored = tier.restore(target.gateway.cache, namespace, key, done)
        if not restored:
            target.move_refused("directory")
            return MoveOutcome(False, refusal="directory")
        seconds = self._clock() - started
        self.rates.observe_move(done.positions, seconds)
        target.moved_in()
        return MoveOutcome(True, done.positions, seconds)

    @staticmethod
    def _refused(holder: EngineMember, target: EngineMember, reason: str) -> MoveOutcome:
        target.move_refused(reason)
        log.debug("no move %s -> %s: %s", holder.name, target.name, reason)
        return MoveOutcome(False, refusal=reason)
