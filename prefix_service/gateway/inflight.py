"""In-flight prompt prefills of one gateway's engine, per scope: a request whose prompt shares more
positions with a prefill running now than the cache would give it waits for that prefill's prompt
snapshot (when that is expected to be cheaper than computing them), then looks up again. Keyed by
scope exactly as the cache is: a request never waits for, nor learns of, another scope's prefill.
Spec: docs/PREFIX_CACHE.md#in-flight-prefixes-joined."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from engine_service.api.call_context import CallContext
from engine_service.api.errors import Cancelled, InvalidArgument
from engine_service.api.stream_events import Event, Snapshot, SnapshotKind
from prefix_service.cache.index import common_prefix
from prefix_service.gateway.gateway_backend import EngineStream

# a wait is bounded by the expected cost of computing the positions (``best``); the cap only cuts a long
# prefix on a slow engine, where a join saves the most (docs/PREFIX_CACHE.md#in-flight-prefixes-joined)
DEFAULT_MAX_WAIT_S = 10.0
# the fleet cost model's starting rate (``fleet/rates.py``): used until this engine's prefills measure one
DEFAULT_PREFILL_S_PER_POSITION = 0.0025
MIN_MEASURED_POSITIONS = 32  # a shorter prefill's time is mostly fixed cost: not a rate sample
RATE_ALPHA = 0.2
POLL_S = 0.05  # how often a waiter asks whether its caller is still there
MAX_AGE_S = 600.0  # a prefill registered longer ago is never waited for (one that was never ended)


@dataclass(frozen=True)
class JoinConfig:
    """``max_wait_s``: the longest a request waits for another's prefill (0: joins off);
    ``prefill_s_per_position`` > 0: a fixed rate (0: measured from this engine's own prefills)."""

    max_wait_s: float = DEFAULT_MAX_WAIT_S
    prefill_s_per_position: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_wait_s", "prefill_s_per_position"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"{name} must be a finite number >= 0, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.max_wait_s > 0


@dataclass(frozen=True)
class JoinStats:
    """``joins``: waits that ended with the prefill's snapshot; ``timeouts``: waits that gave up;
    ``failed``: the prefill ended without one; ``wait_s``: seconds all waits took; ``in_flight``: now."""

    joins: int = 0
    timeouts: int = 0
    failed: int = 0
    wait_s: float = 0.0
    in_flight: int = 0
    waiting: int = 0


class Prefill:
    """One generation's prompt prefill: ``tokens`` in ``scope``, computing ``[reused, len(tokens))``
    since ``started`` (monotonic seconds); ended by :meth:`InflightPrefills.end`."""

    def __init__(
        self, scope: str, tokens: tuple[int, ...], reused: int, started: float, beside: int = 1
    ) -> None:
        self.scope, self.tokens, self.reused, self.started = scope, tokens, reused, started
        self.beside = beside  # prefills of its scope in flight as it started, itself included
        self.snapshot = False  # its prompt snapshot came (a handle: stored, or refused by the cache)
        self._done = threading.Event()

    @property
    def computes(self) -> int:
        return len(self.tokens) - self.reused

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def settle(self, snapshot: bool) -> None:
        self.snapshot = snapshot
        self._done.set()


@dataclass(frozen=True)
class Join:
    """Wait for ``prefill`` (its snapshot gives ``shared`` positions) at most ``wait_s`` seconds."""

    prefill: Prefill
    shared: int
    wait_s: float


@dataclass(frozen=True)
class Routable:
    """A request's reuse on this engine as routing scores it: ``reusable`` positions, of which
    ``joining`` only by joining a prefill in flight (its shared positions less the wait's worth);
    ``computes``: what that prefill computes (its load there is the wait, counted already)."""

    reusable: int
    joining: int = 0
    computes: int = 0


def shared_positions(a: Sequence[int], b: Sequence[int]) -> int:
    """The longest common prefix of ``a`` and ``b``."""
    return common_prefix(a, b)


class InflightPrefills:
    """The registry (thread-safe): :meth:`claim` (join or register), :meth:`confirm`, :meth:`track`
    (the engine stream ends it). Rates: measured per engine, from each prefill's registration to its
    prompt snapshot (those of >= MIN_MEASURED_POSITIONS positions), or fixed by the config."""

    def __init__(
        self,
        config: JoinConfig | None = None,
        reusable: Callable[[str, tuple[int, ...]], int] = lambda scope, key: 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self._reusable = config or JoinConfig(), reusable  # reusable: the cache's (no clone)
        self._clock = clock
        self._lock = threading.Lock()
        self._by_scope: dict[str, list[Prefill]] = {}
        self._rate = self.config.prefill_s_per_position or DEFAULT_PREFILL_S_PER_POSITION
        self._samples = 0  # measured prefills: the first replaces the default, later ones average in
        self._joins = self._timeouts = self._failed = self._waiting = 0
        self._wait_s = 0.0

    # -- the prefills ---------------------------------------------------------------------------
    def claim(
        self,
        scope: str,
        tokens: Sequence[int],
        call: CallContext | None = None,
        caller_active: Callable[[], bool] = lambda: True,
        *,
        register: bool = True,
    ) -> Prefill | None:
        """Before a Generate's lookup: wait for the best prefill in flight (deciding again after each
        wait, all within ``max_wait_s`` and ``call``'s deadline, until ``caller_active()`` is False), or
        register this prompt's own (``register``); -> the prefill to :meth:`confirm` (None: none).
        Spec: docs/PREFIX_CACHE.md."""
        if not self.config.enabled or len(tokens) < 2:
            return None
        key = tuple(tokens)
        left = call.remaining() if call is not None else None
        deadline = self._clock() + (
            self.config.max_wait_s if left is None else min(self.config.max_wait_s, left)
        )
        outcome = None
        try:
            while True:
                reused = self._reusable(scope, key)
                with self._lock:
                    join = self._best(scope, key, reused) if self._clock() < deadline else None
                    if join is None:
                        return self._register(scope, key, reused) if register else None
                outcome = self._wait_for(join, min(deadline, self._clock() + join.wait_s), caller_active)
        finally:
            self._count(outcome)

    def confirm(self, prefill: Prefill | None, reused: int, captured: bool) -> Prefill | None:
        """After the lookup: ``prefill`` computes from ``reused`` when its prompt snapshot is
        ``captured``; else it is ended (None)."""
        if prefill is None:
            return None
        if not captured or reused >= len(prefill.tokens):
            self.end(prefill)
            return None
        with self._lock:
            prefill.reused = reused
        return prefill

    def end(self, prefill: Prefill | None, *, snapshot: bool = False) -> None:
        """``prefill``'s prompt snapshot was handled (``snapshot``) or its generation ended; idempotent."""
        if prefill is None or prefill.done:
            return
        elapsed = self._clock() - prefill.started
        with self._lock:
            running = self._by_scope.get(prefill.scope, [])
            if prefill not in running:  # ended meanwhile (a stream's reader and a cancel at once)
                return
            running.remove(prefill)
            if not running:
                self._by_scope.pop(prefill.scope, None)
            measured = not self.config.prefill_s_per_position
            if snapshot and measured and prefill.computes >= MIN_MEASURED_POSITIONS:
                # a position's time alone: the engine shared itself among those in flight meanwhile
                sharing = (prefill.beside + len(running) + 1) / 2
                sample = max(elapsed, 0.0) / prefill.computes / sharing
                alpha = RATE_ALPHA if self._samples else 1.0
                self._rate = max(1e-6, (1 - alpha) * self._rate + alpha * sample)
                self._samples += 1
        prefill.settle(snapshot)

    def track(self, stream: EngineStream, prefill: Prefill | None) -> EngineStream:
        """``stream`` ending ``prefill`` once its prompt snapshot was handled, or as it ends."""
        return stream if prefill is None else TrackedStream(stream, prefill, self)

    # -- the choice -----------------------------------------------------------------------------
    def rate(self) -> float:
        """Seconds per prefilled position on this engine (fixed, measured, or the default)."""
        with self._lock:
            return self._rate

    def remaining_s(self, prefill: Prefill) -> float:
        """``prefill``'s expected seconds to its prompt snapshot (>= 0)."""
        with self._lock:
            return self._remaining_s(prefill, self._clock(), self._shared_rate(prefill.scope))

    def best(self, scope: str, tokens: Sequence[int], reused: int) -> Join | None:
        """The prefill of ``scope`` worth waiting for: it gives ``tokens`` more than ``reused``
        positions (at most ``len(tokens) - 1``: a lookup clones no further) and is expected to store
        them sooner than this request would compute them, and within ``max_wait_s``; the most
        positions, then the soonest. The wait is bounded by that expected cost and ``max_wait_s``."""
        with self._lock:
            return self._best(scope, tokens, reused)

    def routable(self, scope: str, key: tuple[int, ...]) -> Routable:
        """What routing scores a request of ``key`` by here (see :class:`Routable`)."""
        stored = self._reusable(scope, key)
        join = self.best(scope, key, stored)
        if join is None:
            return Routable(stored)
        with self._lock:
            rate = self._shared_rate(scope)
        lost = math.ceil(self.remaining_s(join.prefill) / rate)  # the wait, in positions
        if join.shared - lost <= stored:
            return Routable(stored)
        return Routable(join.shared - lost, join.shared - lost - stored, join.prefill.computes)

    def stats(self) -> JoinStats:
        with self._lock:
            in_flight = sum(len(p) for p in self._by_scope.values())
            return JoinStats(
                self._joins, self._timeouts, self._failed, self._wait_s, in_flight, self._waiting
            )

    def _register(self, scope: str, tokens: tuple[int, ...], reused: int) -> Prefill | None:
        """A new prefill of ``tokens`` from ``reused`` (lock held; None when nothing is computed)."""
        if reused >= len(tokens):
            return None
        running = self._by_scope.setdefault(scope, [])
        prefill = Prefill(scope, tokens, reused, self._clock(), len(running) + 1)
        running.append(prefill)
        return prefill

    def _best(self, scope: str, tokens: Sequence[int], reused: int) -> Join | None:
        """:meth:`best` (lock held)."""
        if not self.config.enabled:
            return None
        now, rate, best = self._clock(), self._shared_rate(scope), None
        for prefill in self._by_scope.get(scope, ()):
            shared = min(shared_positions(prefill.tokens, tokens), len(tokens) - 1)
            if shared <= max(reused, prefill.reused) or now - prefill.started > MAX_AGE_S:
                continue  # it computes nothing this request lacks (or it was never ended: a leak)
            # computing them here runs beside that prefill, which the engine serves too: at most
            # half speed while both run (a FIFO engine: after it)
            remaining_s = self._remaining_s(prefill, now, rate)
            gain_s = (shared - reused) * rate
            here_s = gain_s + min(remaining_s, gain_s)
            if remaining_s >= min(here_s, self.config.max_wait_s):
                continue
            join = Join(prefill, shared, min(self.config.max_wait_s, here_s))
            if best is None or (join.shared, -join.wait_s) > (best.shared, -best.wait_s):
                best = join
        return best

    def _shared_rate(self, scope: str) -> float:
        """Seconds a position takes while the scope's prefills in flight share the engine (lock held;
        only this scope's are counted: another's never changes what this one sees)."""
        return self._rate * max(1, len(self._by_scope.get(scope, ())))

    @staticmethod
    def _remaining_s(prefill: Prefill, now: float, rate: float) -> float:
        """Until its expected end; once past it, as long again as it has overrun (a prefill late by
        ``x`` is taken to need about ``x`` more: the estimate was off by a factor, not a constant)."""
        return abs(prefill.started + prefill.computes * rate - now)

    def _wait_for(self, join: Join, until: float, caller_active: Callable[[], bool]) -> str:
        """Wait for ``join``'s prefill until ``until``: "joined", "failed" (it ended without a snapshot)
        or "timeout"."""
        started = self._clock()
        with self._lock:
            self._waiting += 1
        try:
            came = self._wait(join.prefill, until, caller_active)
        finally:
            with self._lock:
                self._waiting -= 1
                self._wait_s += max(0.0, self._clock() - started)
        if not came:
            return "timeout"
        return "joined" if join.prefill.snapshot else "failed"

    def _count(self, outcome: str | None) -> None:
        """A claim's last wait, counted once (see :class:`JoinStats`)."""
        with self._lock:
            self._joins += outcome == "joined"
            self._timeouts += outcome == "timeout"
            self._failed += outcome == "failed"

    def _wait(self, prefill: Prefill, deadline: float, caller_active: Callable[[], bool]) -> bool:
        while True:
            left = deadline - self._clock()
            if left <= 0:
                return prefill.done
            if prefill.wait(min(POLL_S, left)):
                return True
            if not caller_active():
                raise Cancelled("the caller left while waiting for a shared prefix being prefilled")


class TrackedStream:
    """An engine stream that ends its :class:`Prefill`: after the prompt snapshot event was handed
    on and its reader asked for more (the gateway stored it meanwhile), or as the stream ends."""

    def __init__(self, stream: EngineStream, prefill: Prefill, registry: InflightPrefills) -> None:
        self._stream, self._prefill, self._registry = stream, prefill, registry
        self._handed_on = False  # the prompt snapshot event was handed on (with a handle)

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        if self._handed_on:
            self._registry.end(self._prefill, snapshot=True)
        try:
            event = next(self._stream)
        except BaseException:
            self._registry.end(self._prefill)
            raise
        if isinstance(event, Snapshot) and event.kind == SnapshotKind.PROMPT:
            if event.handle:
                self._handed_on = True
            else:  # refused by the engine: nothing will be stored
                self._registry.end(self._prefill)
        return event

    def cancel(self) -> None:
        self._stream.cancel()
        self._registry.end(self._prefill, snapshot=self._handed_on)
