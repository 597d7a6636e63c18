"""The fleet's view of one engine: :class:`EngineMember` (its gateway and what routing reads of it) and
:class:`RoutedStream` (a gateway stream on the engine that serves it)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator
from dataclasses import replace

from engine_service.api.stream_events import Done, Tokens
from prefix_service.fleet.route import Candidate
from prefix_service.gateway.calls import GatewayEvent
from prefix_service.gateway.gateway import Gateway
from prefix_service.gateway.stream import GatewayStream


class EngineMember:
    """One engine of the fleet: ``name`` (its address, ``LookupResponse.engine``), ``serving()`` (its
    health watch), ``close()`` (release its connection once it left)."""

    def __init__(
        self,
        name: str,
        gateway: Gateway,
        serving: Callable[[], bool] = lambda: True,
        close: Callable[[], None] = lambda: None,
    ) -> None:
        self.name, self.gateway, self._serving, self._close = name, gateway, serving, close
        self._lock = threading.Lock()
        self.in_flight = 0  # gateway generations this service runs there now
        self.pending = 0  # positions they still have to prefill (not yet at their first token)
        self.routed = 0  # requests whose route put it first
        self.load_guarded = 0  # requests that went elsewhere because it was overloaded
        self.draining = False  # its engine said it drains (the pool's probe): a source of moves only
        self.moves_in = 0  # snapshots moved to it (``moves.py``)
        self.moves_out = 0  # snapshots moved from it
        self.move_refusals: Counter[str] = Counter()  # moves to it that did not happen, by reason
        self._others = 0  # the engine's load beyond this service's own, as of the last Info

    @property
    def fingerprint(self) -> str:
        return self.gateway.fingerprint

    @property
    def serving(self) -> bool:
        return self._serving()

    @property
    def pinned_exports(self) -> bool:
        """The last Info's ``pinned_exports`` (False until one was read)."""
        info = self.gateway.last_info
        return info is not None and info.pinned_exports

    @property
    def load(self) -> int:
        """Generations running or queued there: this service's now, plus the rest as last read."""
        return self.in_flight + self._others

    def candidate(self, namespace: str, key: tuple[int, ...]) -> Candidate:
        """What routing knows of this engine for the prompt ``key``."""
        gateway = self.gateway
        # a prefill in flight to join: its wait counts in the reuse, so its generation not in the load
        seen = gateway.inflight.routable(namespace, key)
        joined = 1 if seen.joining else 0
        return Candidate(
            self.name,
            seen.reusable,
            max(0, self.load - joined),
            gateway.positions,
            gateway.fill(),
            max(0, self.pending - seen.computes),
            self.pinned_exports,
            seen.joining,
        )

    def observe(self) -> None:
        """Take the engine's own load from the Info its gateway read last."""
        info = self.gateway.last_info
        if info is None:
            return
        with self._lock:
            self._others = max(0, info.active_generations + info.queued_commands - self.in_flight)

    def started(self, positions: int = 0) -> None:
        """A generation that will prefill ``positions`` starts there."""
        with self._lock:
            self.in_flight += 1
            self.pending += positions

    def prefilled(self, positions: int) -> None:
        """A generation's prefill of ``positions`` is done (its first token came, or it ended)."""
        with self._lock:
            self.pending -= positions

    def ended(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def moved_in(self) -> None:
        with self._lock:
            self.moves_in += 1

    def moved_out(self) -> None:
        with self._lock:
            self.moves_out += 1

    def move_refused(self, reason: str) -> None:
        with self._lock:
            self.move_refusals[reason] += 1

    def close(self) -> None:
        self._close()


class RoutedStream:
    """A gateway stream on the engine that serves it: its ``Done`` names the engine, whose in-flight
    count drops once it ends; ``on_done(done, ttft_s)`` measures from ``started_at`` (perf_counter)."""

    def __init__(
        self,
        stream: GatewayStream,
        member: EngineMember,
        on_done: Callable[[Done, float], None] = lambda done, ttft_s: None,
        started_at: float | None = None,
        positions: int = 0,
    ) -> None:
        self._stream, self._member, self._on_done = stream, member, on_done
        self._started_at = time.perf_counter() if started_at is None else started_at
        self._first_token_s = 0.0
        self._positions = positions  # to prefill: the member's pending count until the first token
        self._ended = False
        self._lock = threading.Lock()

    @property
    def engine(self) -> str:
        return self._member.name

    def stop(self) -> None:
        self._stream.stop()

    def __iter__(self) -> Generator[GatewayEvent, None, None]:
        try:
            with contextlib.closing(iter(self._stream)) as events:
                for event in events:
                    if isinstance(event, Tokens) and not self._first_token_s:
                        self._first_token_s = time.perf_counter() - self._started_at
                        self._prefilled()
                    if isinstance(event, Done):
                        self._on_done(event, self._first_token_s)
                        event = replace(event, engine=self._member.name)
                    yield event
        finally:
            self._end()

    def _end(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._prefilled()
        self._member.ended()

    def _prefilled(self) -> None:
        with self._lock:
            positions, self._positions = self._positions, 0
        if positions:
            self._member.prefilled(positions)

    def __del__(self) -> None:  # never iterated (e.g. the caller failed before reading it)
        self._end()
