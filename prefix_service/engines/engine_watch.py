"""The engine's availability as the prefix service follows it: it serves again within a second of an
engine restart.

- :data:`RECONNECT_OPTIONS`: the engine channel reconnects after 100 ms, then at most every 300 ms
  while the engine is unreachable (``grpc.min_reconnect_backoff_ms`` is gRPC's minimum connect
  timeout: 5 s, for slow handshakes). No keepalive pings: servers answer frequent ones with GOAWAY.
- :func:`caller_deadline`: engine calls made for an RPC (:func:`call_timeout`) carry its deadline,
  capped by the backend's timeout, and wait for a reconnecting channel (``wait_for_ready``).
- :class:`EngineWatch`: a thread on the engine's ``grpc.health.v1`` Health.Watch stream,
  re-subscribing with a capped backoff. A transition to SERVING first runs ``on_serving`` (the
  gateway's restart check), then releases the calls waiting for the engine; every transition calls
  ``on_change``.
- During an outage an engine call waits for SERVING at most ``outage_wait_s`` per incoming RPC (all
  its engine calls together), never past its deadline, then raises Unavailable.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.api.errors import Unavailable
from protos import engine_pb2

log = logging.getLogger(__name__)

ENGINE_SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name  # as the engine registers it
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 300),
    ("grpc.min_reconnect_backoff_ms", 5000),  # the minimum connect timeout (see the module docstring)
)
OUTAGE_WAIT_S = 1.0  # how long one incoming RPC waits for an unreachable engine before UNAVAILABLE
RESUBSCRIBE_S = (0.05, 0.5)  # the watch's re-subscribe backoff: first wait, cap
_NO_DEADLINE_S = 1e9  # grpc reports "no deadline" as a time remaining of ~9e18 s


@dataclass
class _CallBudget:
    """One incoming RPC's limits on its engine calls (monotonic times; None: unbounded)."""

    deadline: float | None
    outage_until: float | None = None  # set by the first wait for an unreachable engine


_budget: contextvars.ContextVar[_CallBudget | None] = contextvars.ContextVar(
    "forkline_engine_budget", default=None
)


@contextlib.contextmanager
def caller_deadline(context: grpc.ServicerContext) -> Iterator[None]:
    """Within the block, engine calls carry the deadline of the RPC ``context`` serves."""
    remaining = context.time_remaining()
    deadline = None if remaining is None or remaining > _NO_DEADLINE_S else time.monotonic() + remaining
    token = _budget.set(_CallBudget(deadline))
    try:
        yield
    finally:
        _budget.reset(token)


def call_timeout(cap: float | None) -> float | None:
    """Seconds an engine call may take: the caller's time left, at most ``cap`` (None: unbounded)."""
    budget = _budget.get()
    left = None if budget is None or budget.deadline is None else max(budget.deadline - time.monotonic(), 0.0)
    if cap is None:
        return left
    return cap if left is None else min(cap, left)


class EngineWatch:
    """See the module docstring. Serving is assumed until the watch learns otherwise (the service
    checked the engine when it connected); :meth:`start` begins watching, :meth:`stop` ends it."""

    def __init__(
        self,
        channel: grpc.Channel,
        *,
        service: str = ENGINE_SERVICE_NAME,
        outage_wait_s: float = OUTAGE_WAIT_S,
    ) -> None:
        self.service = service
        self.outage_wait_s = outage_wait_s
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._serving = threading.Event()
        self._serving.set()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None  # the Watch stream in flight (cancelled by stop)
        self._thread: threading.Thread | None = None
        self._on_serving: Callable[[], None] = lambda: None
        self._on_change: Callable[[bool], None] = lambda serving: None
        self.transitions = 0  # how often the engine went down or came back (tests, logs)

    @property
    def serving(self) -> bool:
        """Whether the engine reports SERVING now, as far as the watch knows."""
        return self._serving.is_set()

    def await_serving(self, timeout: float | None) -> None:
        """Return once the engine is SERVING; raise Unavailable when it is not within this RPC's outage
        allowance (``outage_wait_s``, shared by all its engine calls) or ``timeout`` seconds."""
        if self._serving.is_set() or threading.current_thread() is self._thread:
            return  # the watch's own calls (its restart check) run as it sees the engine serve
        now = time.monotonic()
        budget = _budget.get()
        if budget is None:
            until = now + self.outage_wait_s
        else:
            if budget.outage_until is None:
                budget.outage_until = now + self.outage_wait_s
            until = budget.outage_until
        wait = max(until - now, 0.0) if timeout is None else max(min(until - now, timeout), 0.0)
        if not self._serving.wait(wait):
            raise Unavailable(f"the engine is not serving (waited {wait:.1f} s for it to come back)")

    def start(
        self, *, on_serving: Callable[[], None] | None = None, on_change: Callable[[bool], None] | None = None
    ) -> None:
        """Start the watch thread (once). ``on_serving()`` runs on it after each transition to SERVING,
        ``on_change(serving)`` after every transition; their exceptions are logged."""
        if self._thread is not None:
            return
        self._on_serving = on_serving or self._on_serving
        self._on_change = on_change or self._on_change
        self._thread = threading.Thread(target=self._run, name="forkline-engine-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """End the watch (idempotent); returns once its thread has stopped."""
        self._stopped.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the watch thread ------------------------------------------------------------------------
    def _run(self) -> None:
        pause = RESUBSCRIBE_S[0]
        while not self._stopped.is_set():
            if self._watch_once():
                pause = RESUBSCRIBE_S[0]  # it was SERVING meanwhile: the next break starts afresh
            if self._stopped.is_set():
                return
            self._set(False)  # the stream broke or ended: the engine is gone (or going)
            self._stopped.wait(pause)
            pause = min(pause * 2, RESUBSCRIBE_S[1])

    def _watch_once(self) -> bool:
        """One Watch stream until it breaks; True when it reported SERVING at some point. The call
        waits for the channel (wait_for_ready), so it connects as soon as the channel reconnects."""
        request = health_pb2.HealthCheckRequest(service=self.service)
        call = self._stub.Watch(request, wait_for_ready=True)
        with self._lock:
            self._call = call
        if self._stopped.is_set():
            call.cancel()
        seen_serving = False
        try:
            for reply in call:
                up = reply.status == health_pb2.HealthCheckResponse.SERVING
                seen_serving |= up
                self._set(up)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an engine without health checking
                log.warning("the engine does not implement grpc.health.v1 Watch: not watching it")
                self._stopped.set()
                self._set(True)
            elif not self._stopped.is_set():
                log.debug("engine health watch ended: %s", exc.code())
        finally:
            with self._lock:
                self._call = None
        return seen_serving

    def _set(self, up: bool) -> None:
        if up == self._serving.is_set():
            return
        self.transitions += 1
        if up:
            # the restart check first: the calls waiting for the engine go on only after it, so none
            # of them meets a dead instance's handles (requests read no Info of their own)
            self._notify(self._on_serving)
            self._serving.set()
            log.info("engine is serving again")
        else:
            self._serving.clear()
            log.warning("engine is not serving; engine calls wait up to %.1f s for it", self.outage_wait_s)
        self._notify(lambda: self._on_change(up))

    @staticmethod
    def _notify(callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception:  # noqa: BLE001 - e.g. the engine went down again during the restart check
            log.warning("engine watch callback failed", exc_info=True)
