"""A gRPC server as both services build it (health, reflection, optional TLS and tokens, interceptors)
and :class:`GrpcServer`, the base of both servers' handles, whose ``stop`` drains once."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_service.api.errors import FailedPrecondition
from engine_service.serving.auth import ServerSecurity
from engine_service.serving.drain import LIVENESS_SERVICE, HealthState, InFlight
from engine_service.serving.rpc_metrics import ServiceMetrics
from engine_service.serving.tokens import is_loopback

log = logging.getLogger(__name__)


def build_grpc_server(
    add_servicer: Callable[[Any, grpc.Server], None],
    servicer: Any,
    service_name: str,
    address: str,
    *,
    max_workers: int,
    thread_name_prefix: str,
    security: ServerSecurity | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    in_flight: InFlight | None = None,
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """A started server for ``servicer`` with health and reflection: (server, health servicer, port).
    ``host:0`` picks a port; OSError when unbound. ``interceptors`` run before the security ones."""
    security = security or ServerSecurity()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix),
        options=[("grpc.so_reuseport", 0)],
        # the drain's counter after the metrics (which count its refusals), before auth
        interceptors=(
            *interceptors,
            *((in_flight,) if in_flight is not None else ()),
            *security.interceptors(),
        ),
    )
    add_servicer(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", service_name, LIVENESS_SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if security.credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, security.credentials)
    if port == 0:
        raise OSError(f"could not bind {address}")
    host = address.rsplit(":", 1)[0]
    if not security.authenticates and not is_loopback(host):
        log.warning(
            "%s listens on %s without authentication: anyone who can reach it can act as any owner "
            "(see --auth_tokens)",
            service_name,
            address,
        )
    server.start()
    return server, health_servicer, port


_FLUSH_S = 1.0  # a drained server's wait for the final messages of its finished calls to be written


class GrpcServer:
    """A running service built by :func:`build_grpc_server`; ``metrics`` None when built without;
    ``in_flight`` None: the drain waits for nothing."""

    metrics: ServiceMetrics | None = None

    def __init__(
        self,
        server: grpc.Server,
        servicer: Any,
        health_servicer: health.HealthServicer,
        port: int,
        *,
        service: str = "",
        in_flight: InFlight | None = None,
    ) -> None:
        self.grpc_server = server
        self.servicer = servicer
        self.health = health_servicer
        self.health_state = HealthState(health_servicer, service)
        self.in_flight = in_flight
        self.port = port
        self.drain_seconds: float | None = None  # how long the last drain waited for calls in flight
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def _drain(
        self, grace: float | None, *, after: Callable[[], None], before: Callable[[], None] | None = None
    ) -> None:
        """Once: ``before``, health NOT_SERVING, up to ``grace`` s for the calls in flight, stop the
        server (the rest is cancelled), ``after``."""
        with self._lock:
            if self._stopped.is_set():
                return
            started = time.monotonic()
            if before is not None:
                before()
            if self.in_flight is not None:
                self.in_flight.draining = True
            self.health_state.update(draining=True)
            idle = self.in_flight is None or self.in_flight.wait_idle(grace)
            if not idle:
                log.warning(
                    "%d calls still in flight after the %.1f s grace: cancelled", self.in_flight.count, grace
                )
            self.drain_seconds = time.monotonic() - started
            self.health.enter_graceful_shutdown()
            left = None if grace is None else max(0.0, grace - self.drain_seconds)
            # idle: the last messages of calls that just returned are still being written; let them out
            flush = _FLUSH_S if left is None else min(left, _FLUSH_S)
            self.grpc_server.stop(left if self.in_flight is None else flush if idle else 0).wait()
            after()
            if self.metrics is not None:
                self.metrics.close()
            self._stopped.set()

    def start_metrics(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` until the server stops; the bound port (FailedPrecondition
        without metrics)."""
        if self.metrics is None:
            raise FailedPrecondition(
                "this server was created without metrics (create_server(..., metrics=True))"
            )
        return self.metrics.serve(host, port)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)
