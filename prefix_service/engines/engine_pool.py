"""EnginePool: keeps a :class:`Fleet` in step with the engine addresses ``engine_targets.py`` offers. An
engine is its instance id, not an address (a second address of a member is an alias); an engine leaves
only by what it says of itself (draining, once this service's streams there ended) or by staying away
``leave_after_s``. Spec: docs/ROUTING.md#engines-joining-and-leaving-dns-that-fails-safe."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine_service.api.engine_info import EngineInfo
from engine_service.api.errors import FailedPrecondition, ForklineError, Unavailable
from prefix_service.engines.engine_connection import EngineConnection
from prefix_service.engines.engine_targets import EngineTargets
from prefix_service.engines.engine_watch import EngineWatch
from prefix_service.fleet.fleet import Fleet
from prefix_service.fleet.member import EngineMember
from prefix_service.gateway.gateway import Gateway

log = logging.getLogger(__name__)

DEFAULT_RESOLVE_EVERY_S = 5.0
DEFAULT_LEAVE_AFTER_S = 60.0  # how long an engine may stay unreachable / NOT_SERVING before it leaves
REFRESH_EVERY_S = 1.0  # engines' Info (load, restarts, draining) between resolves
JOIN_TIMEOUT_S = 2.0  # how long a joining engine may take to answer before the next resolve retries it


class RemoteMember(EngineMember):
    """An engine reached over gRPC: serving as its health watch says; ``close`` stops the watch and
    closes the channel. ``addresses``: every address it answered at (its name first)."""

    def __init__(
        self,
        name: str,
        gateway: Gateway,
        watch: EngineWatch | None,
        close: Callable[[], None],
        connection: EngineConnection | None = None,
    ) -> None:
        super().__init__(
            name, gateway, (lambda: watch.serving) if watch is not None else (lambda: True), close
        )
        self.watch, self.connection = watch, connection
        self.addresses: set[str] = {name}

    def probe(self) -> EngineInfo | None:
        """The engine's Info now, without waiting for a down engine (None: no answer)."""
        return self.connection.probe() if self.connection is not None else None

    def model(self) -> str:
        """The model the engine serves (its path; "" without a connection)."""
        return self.connection.model() if self.connection is not None else ""


class OpenedEngine(Protocol):
    """What ``open`` answers: an engine connected at an address, its Info read, not yet a member."""

    info: EngineInfo

    def close(self) -> None: ...


@dataclass(frozen=True)
class PoolStats:
    resolve_failures: int = 0  # DNS resolutions that failed or answered nothing
    answer_age_s: float = 0.0  # of the answer in use
    stale: bool = False
    aliases: int = 0  # addresses found to be another address of a member
    departures: dict[str, int] = field(default_factory=dict)  # members that left, by reason


def _addresses(member: EngineMember) -> set[str]:
    return getattr(member, "addresses", {member.name})


class EnginePool:
    """``open(address, timeout)`` connects and reads Info (failing: retried at the next resolve);
    ``join(opened)`` makes the member. One thread resolves, refreshes every engine's Info about once a
    second and lets members go."""

    def __init__(
        self,
        fleet: Fleet,
        targets: Callable[[], set[str]],
        open: Callable[[str, float], OpenedEngine],
        join: Callable[[OpenedEngine], EngineMember],
        *,
        resolve_every_s: float = DEFAULT_RESOLVE_EVERY_S,
        refresh_every_s: float = REFRESH_EVERY_S,
        leave_after_s: float = DEFAULT_LEAVE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet, self._targets, self._open, self._join = fleet, targets, open, join
        self.resolve_every_s, self.refresh_every_s = resolve_every_s, refresh_every_s
        self.leave_after_s, self._clock = leave_after_s, clock
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._sync_lock = threading.Lock()
        self._away_since: dict[str, float] = {}  # member name -> when it was first seen not serving
        self._departures: Counter[str] = Counter()
        self.aliases = 0
        self.refused: FailedPrecondition | None = None  # the last engine refused as misconfigured
        self.on_join: Callable[[EngineMember], None] = lambda member: None  # e.g. start its health watch

    def sync(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Resolve once and open the addresses no member answers at."""
        with self._sync_lock:
            wanted = self._targets()
            for member in self.fleet.members():  # an alias that went from the answer is forgotten
                if isinstance(member, RemoteMember):
                    member.addresses &= wanted | {member.name}
            known = {a for member in self.fleet.members() for a in _addresses(member)}
            for address in sorted(wanted - known):
                if self._stopped.is_set():
                    return
                self._add(address, timeout)

    def _add(self, address: str, timeout: float) -> None:
        try:
            opened = self._open(address, timeout)
        except FailedPrecondition as exc:
            self._refuse(address, exc)
            return
        except ForklineError as exc:
            log.info("engine %s not ready yet (%s): retrying in %.0f s", address, exc, self.resolve_every_s)
            return
        instance = opened.info.instance_id
        same = next((m for m in self.fleet.members() if m.gateway.instance_id == instance), None)
        if same is not None or opened.info.draining:
            opened.close()
            if same is None:
                log.info("engine %s is draining: not joining it", address)
            elif isinstance(same, RemoteMember):
                same.addresses.add(address)
                self.aliases += 1
                log.info("%s is another address of engine %s (instance %s)", address, same.name, instance)
            return
        try:
            member = self._join(opened)
        except FailedPrecondition as exc:
            self._refuse(address, exc)
        except ForklineError as exc:
            log.info("engine %s could not join (%s): retrying in %.0f s", address, exc, self.resolve_every_s)
        else:
            self.fleet.add(member)
            self.on_join(member)

    def _refuse(self, address: str, exc: FailedPrecondition) -> None:
        """A misconfigured engine: remembered (``start_serving`` raises it when none joins) and logged."""
        self.refused = exc
        log.error("engine %s refused: %s", address, exc)

    def check_departures(self) -> None:
        """Let go of the members whose engine drains or stays away."""
        now = self._clock()
        for member in self.fleet.members():
            if member.serving:
                self._away_since.pop(member.name, None)
                member.draining = False  # e.g. a new instance at its address serves
                continue
            since = self._away_since.setdefault(member.name, now)
            info = member.probe() if isinstance(member, RemoteMember) else None
            if info is not None and info.instance_id != member.gateway.instance_id:
                continue  # another instance answers there: the gateway's restart check adopts it
            if info is not None and info.draining:
                member.draining = True  # not routed to; until it leaves a source of moves (fleet/moves.py)
                if member.in_flight == 0:  # this service's streams through it end first
                    self._leave(member, "draining")
            elif now - since >= self.leave_after_s:
                self._leave(member, "unreachable")

    def _leave(self, member: EngineMember, reason: str) -> None:
        self._away_since.pop(member.name, None)
        self._departures[reason] += 1
        log.warning(
            "engine %s (instance %s) leaves: %s",
            member.name,
            member.gateway.instance_id,
            "it is draining" if reason == "draining" else f"away for {self.leave_after_s:.0f} s",
        )
        self.fleet.remove(member.name)

    def stats(self) -> PoolStats:
        targets = self._targets
        dns = isinstance(targets, EngineTargets)
        return PoolStats(
            resolve_failures=targets.failures if dns else 0,
            answer_age_s=targets.answer_age_s() if dns else 0.0,
            stale=targets.stale if dns else False,
            aliases=self.aliases,
            departures=dict(self._departures),
        )

    def start_serving(self, ready_timeout: float) -> None:
        """Connect the engines there are now; wait up to ``ready_timeout`` for at least one (Unavailable
        otherwise), then keep in step in the background."""
        deadline = time.monotonic() + ready_timeout
        while True:
            self.sync(timeout=max(0.1, min(JOIN_TIMEOUT_S, deadline - time.monotonic())))
            if self.fleet.members() or self.refused is not None or time.monotonic() >= deadline:
                break
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        if not self.fleet.members():
            if self.refused is not None:
                raise self.refused
            raise Unavailable(f"no engine reachable within {ready_timeout} s")
        self._thread = threading.Thread(target=self._run, name="forkline-engine-pool", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        since_resolve = 0.0
        while not self._stopped.wait(self.refresh_every_s):
            since_resolve += self.refresh_every_s
            try:
                if since_resolve >= self.resolve_every_s:
                    since_resolve = 0.0
                    self.sync()
                self.check_departures()
                self.fleet.refresh()
            except Exception:  # noqa: BLE001 - the pool must outlive any one engine's failure
                log.warning("engine pool update failed", exc_info=True)
