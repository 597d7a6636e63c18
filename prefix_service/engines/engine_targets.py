"""Which addresses the engines may be at: ``--engine HOST:PORT`` and ``--engines dns:///NAME:PORT`` (or
``dns://SERVER:PORT/NAME:PORT``). DNS finds engines and never removes one; a failed or empty
resolution keeps the last answer for ``stale_after_s``. Spec: docs/ROUTING.md#engines-joining-and-leaving-dns-that-fails-safe."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_service.api.errors import InvalidArgument
from prefix_service.engines.dns_query import AAAA, DnsError, query
from prefix_service.engines.dns_query import A as A_RECORD

log = logging.getLogger(__name__)

DEFAULT_STALE_AFTER_S = 300.0  # how long a failed / empty resolution keeps the last answer
_DNS_PREFIX = "dns://"
_EXPECTED = "expected dns:///NAME:PORT or dns://SERVER[:PORT]/NAME:PORT with ports in 1..65535"


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host_port(text: str, default_port: int | None) -> tuple[str, int] | None:
    """``HOST:PORT`` / ``[V6]:PORT`` (``HOST`` alone when ``default_port``); None when malformed."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else (None if rest else "")
        if not bracket or port is None:
            return None
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""
    if not port and default_port is not None:
        port = str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


@dataclass(frozen=True)
class Resolution:
    """One resolution: the addresses, or why there are none (``error`` "": the name answered)."""

    addresses: frozenset[str]
    error: str = ""


@dataclass(frozen=True)
class DnsTarget:
    """``dns:///NAME:PORT`` (the system resolver) or ``dns://SERVER[:PORT]/NAME:PORT`` (ask SERVER,
    port 53 by default): every A and AAAA address of ``NAME``, at ``PORT``."""

    host: str
    port: int
    server: tuple[str, int] | None = None

    @classmethod
    def parse(cls, target: str) -> DnsTarget:
        authority, slash, name = target.removeprefix(_DNS_PREFIX).partition("/")
        named = _host_port(name, None)
        server = _host_port(authority, 53) if authority else None
        if not target.startswith(_DNS_PREFIX) or not slash or named is None or (authority and server is None):
            raise InvalidArgument(f"engines: {_EXPECTED}, got {target!r}")
        return cls(named[0], named[1], server)

    def lookup(self) -> Resolution:
        """Resolve now (see :class:`Resolution`)."""
        if self.server is None:
            try:
                infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            except OSError as exc:
                return Resolution(frozenset(), str(exc))
            return Resolution(frozenset(_address(str(info[4][0]), self.port) for info in infos))
        found: set[str] = set()
        errors = []
        for qtype in (A_RECORD, AAAA):
            try:
                found |= {_address(a, self.port) for a in query(self.server, self.host, qtype)}
            except DnsError as exc:
                errors.append(str(exc))
        return Resolution(frozenset(found), "; ".join(errors) if errors and not found else "")

    def resolve(self) -> set[str]:
        """The addresses now (empty when the name does not resolve)."""
        return set(self.lookup().addresses)


class EngineTargets:
    """The addresses to join now (callable): the static ones and the DNS answer, the last good answer
    standing in for a failed or empty one up to ``stale_after_s``."""

    def __init__(
        self,
        static: set[str],
        dns: DnsTarget | None,
        *,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.static, self.dns, self.stale_after_s, self._clock = frozenset(static), dns, stale_after_s, clock
        self._lock = threading.Lock()
        self.answer: frozenset[str] = frozenset()  # the last good DNS answer
        self._answered_at: float | None = None
        self.failures = 0  # resolutions that failed or answered nothing
        self.failing = False  # the last resolution failed (the last answer stands in, or nothing)

    def __call__(self) -> set[str]:
        if self.dns is None:
            return set(self.static)
        resolution = self.dns.lookup()
        now = self._clock()
        with self._lock:
            if resolution.addresses:
                if self.failing:
                    log.warning("%s resolves again: %d addresses", self.dns.host, len(resolution.addresses))
                self.answer, self._answered_at, self.failing = resolution.addresses, now, False
                return set(self.static | self.answer)
            self.failures += 1
            if not self.failing:
                log.warning(
                    "%s: %s; keeping the %d addresses last resolved for up to %.0f s (the engines "
                    "joined stay while they serve)",
                    self.dns.host,
                    resolution.error or "no address",
                    len(self.answer),
                    self.stale_after_s,
                )
            self.failing = True
            return set(self.static) if self._stale(now) else set(self.static | self.answer)

    def _stale(self, now: float) -> bool:
        return self._answered_at is None or now - self._answered_at > self.stale_after_s

    @property
    def stale(self) -> bool:
        """The last answer is past ``stale_after_s`` and no longer offered (False without DNS)."""
        with self._lock:
            return self.dns is not None and self.failing and self._stale(self._clock())

    def answer_age_s(self) -> float:
        """Seconds since the DNS answer in use came (0 without DNS or before any answer)."""
        with self._lock:
            return 0.0 if self._answered_at is None else self._clock() - self._answered_at


def engine_targets(
    engines: list[str] | None, dns: str | None, *, stale_after_s: float = DEFAULT_STALE_AFTER_S
) -> EngineTargets:
    """One resolver over ``--engine`` addresses and an ``--engines dns:`` target (at least one)."""
    static = set(engines or ())
    target = DnsTarget.parse(dns) if dns else None
    if not static and target is None:
        raise InvalidArgument("engine: give --engine HOST:PORT (repeatable) or --engines dns:///NAME:PORT")
    for address in static:
        if not address or ":" not in address:
            raise InvalidArgument(f"engine: expected HOST:PORT, got {address!r}")
    return EngineTargets(static, target, stale_after_s=stale_after_s)
