"""The engine's availability as the prefix service follows it (serving again within a second of an
engine restart), and how long one incoming call's engine calls may wait for a down engine."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.api.call_context import CallContext
from engine_service.api.errors import Unavailable
from protos import engine_pb2

log = logging.getLogger(__name__)

ENGINE_SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name  # as the engine registers it
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 300),
    # gRPC's minimum connect timeout (slow handshakes); no keepalive pings: servers GOAWAY frequent ones
    ("grpc.min_reconnect_backoff_ms", 5000),
)
OUTAGE_WAIT_S = 1.0  # how long one incoming RPC waits for an unreachable engine before UNAVAILABLE
RESUBSCRIBE_S = (0.05, 0.5)  # the watch's re-subscribe backoff: first wait, cap


class OutageAllowance:
    """When one incoming call stops waiting for down engines: set by its first wait (``outage_wait_s``
    from then), shared by all its engine calls."""

    def __init__(self) -> None:
        self._until: float | None = None
        self._lock = threading.Lock()

    def until(self, now: float, wait_s: float) -> float:
        with self._lock:
            if self._until is None:
                self._until = now + wait_s
            return self._until


@dataclass(frozen=True)
class RpcCall(CallContext):
    """A gRPC call to this service: its CallContext and the outage allowance its engine calls share."""

    outage: OutageAllowance = field(default_factory=OutageAllowance, compare=False, repr=False)

    @classmethod
    def of(cls, call: CallContext) -> RpcCall:
        return cls(call.owner, call.credential, call.deadline)


def outage_of(call: CallContext | None) -> OutageAllowance | None:
    """The allowance ``call`` shares among its engine calls (None: each waits on its own)."""
    return call.outage if isinstance(call, RpcCall) else None


def call_timeout(cap: float | None, call: CallContext | None = None) -> float | None:
    """Seconds an engine call may take: ``call``'s time left, at most ``cap`` (None: unbounded)."""
    left = None if call is None else call.remaining()
    if cap is None:
        return left
    return cap if left is None else min(cap, left)


class EngineWatch:
    """A thread on the engine's ``grpc.health.v1`` Watch stream (re-subscribing with a capped backoff).
    Serving is assumed until it learns otherwise; a transition to SERVING runs ``on_serving`` (the
    restart check) before it releases the waiting calls."""

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

    def await_serving(self, timeout: float | None, allowance: OutageAllowance | None = None) -> None:
        """Return once the engine is SERVING; Unavailable when it is not within ``allowance`` (the
        incoming call's, shared by its engine calls; None: ``outage_wait_s`` from now) or ``timeout``."""
        if self._serving.is_set() or threading.current_thread() is self._thread:
            return  # the watch's own calls (its restart check) run as it sees the engine serve
        now = time.monotonic()
        until = (allowance or OutageAllowance()).until(now, self.outage_wait_s)
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
        """One Watch stream until it breaks (waiting for the channel); whether it reported SERVING."""
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
