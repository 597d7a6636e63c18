"""Moving a stored snapshot to another engine instead of recomputing its prompt there.

When the route's first engine is not the one holding the request's prefix (that one is loaded or
draining) and moving is cheaper than prefilling (``cost_model.py``), :meth:`SnapshotMover.move`
copies the holder's stored entry to the first engine before the request is served there:

1. the holder's entry that scores the prompt (``PrefixCache.reusable_entry``) -- gone: no move;
2. its exact length checked once more: ``rates.move_s(len(entry)) < s_pos * (reused there - reused
   here)``, or no move (``slower``): a move never costs more than the recompute it saves;
3. ``ExportSession`` on the holder streamed, chunk by chunk, into ``ImportSession`` on the target:
   the bytes pass through this service (engines never call each other: no engine-to-engine
   addresses, credentials or trust; this service already holds a persistent owner's token on both,
   and one more hop on the same network costs less than a millisecond per MiB here). The target
   engine checks the file as any load (format, checksum, signature with ``--snapshot_key``, content,
   fingerprint, geometry) and reports the content digest of what it loaded;
4. the new session is inserted into the target's cache under the entry's namespace, tokens and
   metadata: the cache verifies the digest against the tokens as for any insert, and its listener
   hears ``MOVED`` (``cache/events.py``). The original stays on the holder.

A move that does not happen says why (:class:`MoveOutcome`); the request then computes what the target
lacks, exactly as without moves. Concurrent requests for the same prefix and target share one move
(the later ones wait for it). Each finished move's seconds feed the fleet's rates
(``rates.RateMeter.observe_move``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine_service.api.errors import ForklineError
from prefix_service.fleet.member import EngineMember
from prefix_service.fleet.rates import RateMeter
from prefix_service.tier.snapshot_backend import SnapshotBackend
from prefix_service.tier.snapshot_store import extra_for

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0  # how long a request waits for the same move another request is making


@dataclass(frozen=True)
class MoveOutcome:
    """``moved``: the target now holds a copy of ``positions`` positions (it took ``seconds``);
    otherwise ``refusal`` says why not: ``gone`` (the holder no longer has it), ``slower``,
    ``unsupported`` (an engine without snapshot files), ``export`` (the holder refused),
    ``import:<reason>`` (the target refused the file), ``insert:<reason>`` (the target's cache did
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
        """Copy ``holder``'s entry for ``key`` (under ``namespace``) into ``target``, whose own cache
        reuses ``reused_there`` positions of it; see the module docstring. Never raises for the
        engines' failures: they are a refusal (the request recomputes)."""
        found = holder.gateway.cache.reusable_entry(namespace, key)
        if found is None:
            return self._refused(holder, target, "gone")
        entry, reused = found
        rates = self.rates.rates()
        if rates.move_s(entry.key_length) >= rates.prefill_s_per_position * (reused - reused_there):
            return self._refused(holder, target, "slower")
        source, sink = holder.gateway.backend, target.gateway.backend
        if not isinstance(source, SnapshotBackend) or not isinstance(sink, SnapshotBackend):
            return self._refused(holder, target, "unsupported")
        ticket = (target.name, namespace, entry.tokens)
        with self._lock:
            running = self._moving.get(ticket)
            if running is None:
                self._moving[ticket] = threading.Event()
        if running is not None:
            running.wait(JOIN_TIMEOUT_S)
            return self._refused(holder, target, "joined")
        try:
            return self._copy(holder, target, namespace, entry.tokens, entry.metadata, entry.snapshot)
        finally:
            with self._lock:
                self._moving.pop(ticket).set()

    def _copy(
        self,
        holder: EngineMember,
        target: EngineMember,
        namespace: str,
        tokens: tuple[int, ...],
        metadata: Mapping[str, str],
        handle: object,
    ) -> MoveOutcome:
        started = self._clock()
        try:
            chunks = holder.gateway.backend.export_session(handle, extra_for(namespace, tokens, metadata))
            if chunks is None:
                return self._refused(holder, target, "export")
            imported = target.gateway.backend.import_session(chunks)
        except ForklineError as exc:
            log.info("move %s -> %s failed: %s", holder.name, target.name, exc)
            return self._refused(holder, target, type(exc).__name__)
        if imported.handle is None:
            return self._refused(holder, target, f"import:{imported.refusal}")
        outcome = target.gateway.cache.insert(
            namespace, tokens, imported.handle, metadata, moved_from=holder.name
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

    @staticmethod
    def _refused(holder: EngineMember, target: EngineMember, reason: str) -> MoveOutcome:
        target.move_refused(reason)
        log.debug("no move %s -> %s: %s", holder.name, target.name, reason)
        return MoveOutcome(False, refusal=reason)
