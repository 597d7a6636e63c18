"""A service's health (readiness under its own name, ``""``, liveness) and the drain that keeps health
answering while calls finish; the listed methods are refused UNAVAILABLE meanwhile.
Spec: docs/DEPLOY.md (health, drain and disruptions).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from engine_service.serving.auth import OPEN_METHOD_PREFIXES, rebuild_handler

LIVENESS_SERVICE = "forkline.liveness"  # SERVING while the process does its work, drain included
_STATUS = health_pb2.HealthCheckResponse


class HealthState:
    """One server's health statuses from ``alive`` / ``ready`` / ``draining`` (thread-safe)."""

    def __init__(self, servicer: health.HealthServicer, service: str) -> None:
        self._servicer, self.service = servicer, service
        self._lock = threading.Lock()
        self.alive = self.ready = True
        self.draining = False
        self._publish()

    def update(
        self, *, alive: bool | None = None, ready: bool | None = None, draining: bool | None = None
    ) -> None:
        with self._lock:
            self.alive = self.alive if alive is None else alive
            self.ready = self.ready if ready is None else ready
            self.draining = self.draining if draining is None else draining
            self._publish()

    @property
    def serving(self) -> bool:
        """What the readiness probe sees."""
        return self.alive and self.ready and not self.draining

    def _publish(self) -> None:
        def status(up: bool) -> int:
            return _STATUS.SERVING if up else _STATUS.NOT_SERVING

        self._servicer.set(self.service, status(self.serving))  # readiness
        self._servicer.set("", status(self.alive and not self.draining))  # the server as a whole
        # draining included: a draining pod is not restarted mid-drain
        self._servicer.set(LIVENESS_SERVICE, status(self.alive))


class InFlight(grpc.ServerInterceptor):
    """Counts the calls in flight (health and reflection excepted); while :attr:`draining`, the full
    method names in ``refuse`` answer UNAVAILABLE without running."""

    def __init__(self, refuse: Collection[str] = ()) -> None:
        self.refuse = frozenset(refuse)
        self.draining = False
        self._count = 0
        self._idle = threading.Condition()

    @property
    def count(self) -> int:
        with self._idle:
            return self._count

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no call is in flight (at most ``timeout`` seconds; None: no bound); whether none is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._count > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
            return True

    def _enter(self) -> None:
        with self._idle:
            self._count += 1

    def _leave(self) -> None:
        with self._idle:
            self._count -= 1
            if self._count == 0:
                self._idle.notify_all()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        return rebuild_handler(handler, lambda behaviour, streams: self._wrap(method, behaviour, streams))

    def _wrap(self, method: str, behaviour: Callable[..., Any], streams: bool) -> Callable[..., Any]:
        def refuse_while_draining(context: grpc.ServicerContext) -> None:
            if self.draining and method in self.refuse:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the service is draining: try another replica")

        if streams:

            def run_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                refuse_while_draining(context)
                self._enter()
                try:
                    yield from behaviour(request, context)
                finally:
                    self._leave()

            return run_stream

        def run(request: Any, context: grpc.ServicerContext) -> Any:
            refuse_while_draining(context)
            self._enter()
            try:
                return behaviour(request, context)
            finally:
                self._leave()

        return run
