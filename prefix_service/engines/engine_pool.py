"""The prefix service's engines over gRPC: who they are (static addresses or a DNS name re-resolved
every few seconds) and their connections, kept in a :class:`~prefix_service.fleet.fleet.Fleet`.

- Targets: ``--engine HOST:PORT`` (repeatable) names engines one by one; ``--engines
  dns:///NAME:PORT`` names every address ``NAME`` resolves to (a Kubernetes headless Service gives
  one address per engine pod), re-resolved every ``--resolve_every`` seconds. :func:`engine_targets`
  turns the flags into one resolver.
- :class:`EnginePool` keeps the fleet in step with the targets on a background thread: an address
  that appears is connected (``connect_engine``: its channel, health watch, the release of what an
  earlier instance of this service left there, the budget) and starts taking traffic; one that
  disappears leaves the fleet (its entries dropped, its channel closed). An engine that does not
  answer yet is tried again at the next resolve. The same thread refreshes every engine's Info about
  once a second (restart detection and load for routing).
- :class:`RemoteMember`: a fleet member whose health comes from its :class:`EngineWatch`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_service.api.errors import FailedPrecondition, ForklineError, InvalidArgument, Unavailable
from prefix_service.engines.engine_watch import EngineWatch
from prefix_service.fleet.fleet import EngineMember, Fleet
from prefix_service.gateway.gateway import Gateway

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
DEFAULT_RESOLVE_EVERY_S = 5.0
REFRESH_EVERY_S = 1.0  # engines' Info (load, restarts) between resolves
JOIN_TIMEOUT_S = 2.0  # how long a joining engine may take to answer before the next resolve retries it


class RemoteMember(EngineMember):
    """An engine reached over gRPC: serving as its health watch says; ``close`` stops the watch and
    closes the channel."""

    def __init__(
        self, name: str, gateway: Gateway, watch: EngineWatch | None, close: Callable[[], None]
    ) -> None:
        super().__init__(
            name, gateway, (lambda: watch.serving) if watch is not None else (lambda: True), close
        )
        self.watch = watch


@dataclass(frozen=True)
class DnsTarget:
    """``dns:///NAME:PORT``: every address ``NAME`` resolves to, at ``PORT``."""

    host: str
    port: int

    @classmethod
    def parse(cls, target: str) -> DnsTarget:
        if not target.startswith(DNS_SCHEME):
            raise InvalidArgument(f"engines: expected {DNS_SCHEME}NAME:PORT, got {target!r}")
        host, sep, port = target[len(DNS_SCHEME) :].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(
                f"engines: expected {DNS_SCHEME}NAME:PORT with a port in 1..65535, got {target!r}"
            )
        return cls(host.strip("[]"), int(port))

    def resolve(self) -> set[str]:
        """The addresses now (empty when the name does not resolve: no engine yet)."""
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("could not resolve %s: %s", self.host, exc)
            return set()
        return {
            f"[{info[4][0]}]:{self.port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{self.port}"
            for info in infos
        }


def engine_targets(engines: list[str] | None, dns: str | None) -> Callable[[], set[str]]:
    """One resolver over ``--engine`` addresses and an ``--engines dns:///`` target (at least one)."""
    static = set(engines or ())
    target = DnsTarget.parse(dns) if dns else None
    if not static and target is None:
        raise InvalidArgument("engine: give --engine HOST:PORT (repeatable) or --engines dns:///NAME:PORT")
    for address in static:
        if not address or ":" not in address:
            raise InvalidArgument(f"engine: expected HOST:PORT, got {address!r}")
    return lambda: static | (target.resolve() if target is not None else set())


class EnginePool:
    """Keeps ``fleet`` in step with ``targets()`` (see the module docstring). ``connect(address,
    timeout)`` builds a member for a new engine (raising a ForklineError when it cannot: retried at
    the next resolve; FailedPrecondition, a misconfigured engine, is logged as an error)."""

    def __init__(
        self,
        fleet: Fleet,
        targets: Callable[[], set[str]],
        connect: Callable[[str, float], EngineMember],
        *,
        resolve_every_s: float = DEFAULT_RESOLVE_EVERY_S,
        refresh_every_s: float = REFRESH_EVERY_S,
    ) -> None:
        self.fleet, self._targets, self._connect = fleet, targets, connect
        self.resolve_every_s, self.refresh_every_s = resolve_every_s, refresh_every_s
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._sync_lock = threading.Lock()
        self.refused: FailedPrecondition | None = None  # the last engine refused as misconfigured
        self.on_join: Callable[[EngineMember], None] = lambda member: None  # e.g. start its health watch

    def sync(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Resolve once: connect engines that appeared, remove those that went."""
        with self._sync_lock:
            wanted = self._targets()
            present = {m.name for m in self.fleet.members()}
            for name in sorted(present - wanted):
                self.fleet.remove(name)
            for address in sorted(wanted - present):
                if self._stopped.is_set():
                    return
                try:
                    member = self._connect(address, timeout)
                except FailedPrecondition as exc:
                    self.refused = exc
                    log.error("engine %s refused: %s", address, exc)
                except ForklineError as exc:
                    log.info(
                        "engine %s not ready yet (%s): retrying in %.0f s", address, exc, self.resolve_every_s
                    )
                else:
                    self.fleet.add(member)
                    self.on_join(member)

    def start_serving(self, ready_timeout: float) -> None:
        """Connect the engines there are now; wait up to ``ready_timeout`` for at least one (Unavailable
        otherwise), then keep in step in the background."""
        deadline = time.monotonic() + ready_timeout
        while True:
            self.sync(timeout=max(0.1, deadline - time.monotonic()))
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
                self.fleet.refresh()
            except Exception:  # noqa: BLE001 - the pool must outlive any one engine's failure
                log.warning("engine pool update failed", exc_info=True)
