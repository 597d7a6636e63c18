"""SnapshotMover: a prefix's snapshot copied from the engine that holds it (or from the snapshot
directory) to the engine a request is routed to, through the gateways. Spec: docs/ROUTING.md#moves."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine_service.api.call_context import CallContext
from engine_service.api.errors import ForklineError
from prefix_service.fleet.member import EngineMember
from prefix_service.fleet.rates import RateMeter
from prefix_service.tier.persistent_tier import Restored

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0  # how long a request waits for the same move another request is making


@dataclass(frozen=True)
class MoveOutcome:
    """``moved``: the target now holds ``positions`` positions (in ``seconds``); else ``refusal``: gone,
    slower, unsupported, export, directory, import:<reason>, insert:<reason>, joined, or an error's
    type name (docs/ROUTING.md#moves)."""

    moved: bool
    positions: int = 0
    seconds: float = 0.0
    refusal: str = ""


class SnapshotMover:
    """Concurrent requests for the same prefix and target share one move (the later ones wait for it);
    each finished move's seconds feed ``rates``. ``clock``: monotonic seconds."""

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
        reuses ``reused_there`` positions of it. Never raises for the engines' failures: they are a
        refusal (the request recomputes)."""
        found = holder.gateway.reusable_entry(namespace, key)
        if found is None:
            return self._refused(holder, target, "gone")
        entry, reused = found
        # the entry itself when the request reuses (nearly) all of it, else the prefix it reuses
        tokens = entry.tokens if reused >= entry.key_length - 1 else entry.tokens[:reused]
        rates = self.rates.rates()
        if rates.move_s(len(tokens)) >= rates.prefill_s_per_position * (reused - reused_there):
            return self._refused(holder, target, "slower")
        if not (holder.gateway.has_files and target.gateway.has_files):
            return self._refused(holder, target, "unsupported")
        with self._turn((target.name, namespace, tokens)) as first:
            if not first:
                return self._refused(holder, target, "joined")
            started = [self._clock()]

            def export() -> Iterator[bytes] | None:
                started[0] = self._clock()  # the move's seconds: export, import and insert
                return holder.gateway.export(namespace, entry, tokens)

            try:
                refusal = target.gateway.accept_move(namespace, tokens, entry.metadata, export, holder.name)
            except ForklineError as exc:
                log.info("move %s -> %s failed: %s", holder.name, target.name, exc)
                return self._refused(holder, target, type(exc).__name__)
        if refusal:
            return self._refused(holder, target, refusal)
        seconds = self._clock() - started[0]
        self.rates.observe_move(len(tokens), seconds)
        holder.moved_out()
        target.moved_in()
        log.info(
            "moved %d positions %s -> %s in %.1f ms", len(tokens), holder.name, target.name, seconds * 1e3
        )
        return MoveOutcome(True, len(tokens), seconds)

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

    def restore(
        self,
        target: EngineMember,
        namespace: str,
        key: tuple[int, ...],
        positions: int,
        call: CallContext | None = None,
    ) -> MoveOutcome:
        """A move from the snapshot directory: its longest stored prefix of ``key`` (``positions``
        long, as routing read it) restored into ``target``, measured as a move; concurrent restores
        of it share one (``joined``); ``directory`` when nothing was stored."""
        with self._turn((target.name, namespace, tuple(key[:positions]))) as first:
            if not first:
                target.move_refused("joined")
                return MoveOutcome(False, refusal="joined")
            started, done = self._clock(), Restored()
            restored = target.gateway.restore(namespace, key, done, call)
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
