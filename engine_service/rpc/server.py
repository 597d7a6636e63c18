"""The engine gRPC server: servicer + health checking + reflection + idle-handle sweeper.

``create_server(deps, address) -> (server, port)`` binds (``127.0.0.1:0`` picks a free port), starts
serving and returns an :class:`EngineServer`. ``server.stop(grace)`` drains: new calls get
UNAVAILABLE and health reports NOT_SERVING, in-flight streams get ``grace`` seconds to finish, then
the remaining ones are cancelled and every handle still registered is closed. The runner belongs to
the caller (``python -m engine_service`` shuts it down after the server). ``metrics=True`` collects
Prometheus metrics (``rpc/metrics.py``); ``server.start_metrics(host, port)`` serves them.
"""

from __future__ import annotations

import logging
import threading

import grpc
from grpc_health.v1 import health

from engine_service.rpc.metrics import EngineMetrics
from engine_service.rpc.servicer import EngineDeps, EngineServicer
from engine_service.serving.auth import ServerSecurity
from engine_service.serving.service_main import GrpcServer, build_grpc_server
from protos import engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
MAX_WORKERS = 64  # each streaming Generate holds a worker thread for its duration


class HandleSweeper:
    """Closes sessions whose handles were idle longer than the registry's timeout."""

    def __init__(self, deps: EngineDeps) -> None:
        self._deps = deps
        self._stop = threading.Event()
        timeout = deps.registry.idle_timeout_s
        self._interval = min(1.0, timeout / 4) if timeout > 0 else 0.0
        self._thread = threading.Thread(target=self._run, name="forkline-handle-sweeper", daemon=True)

    def start(self) -> None:
        if self._interval > 0:
            self._thread.start()

    def sweep(self) -> int:
        expired = self._deps.registry.expire_idle()
        for r in expired:
            log.info(
                "session handle of %s expired after %.1f s idle", r.owner, self._deps.registry.idle_timeout_s
            )
            r.value.close()
        return len(expired)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sweep()

    def stop(self) -> None:
        self._stop.set()


class EngineServer(GrpcServer):
    """A running engine server. ``port`` is the bound port."""

    servicer: EngineServicer

    def __init__(
        self,
        server: grpc.Server,
        servicer: EngineServicer,
        health_servicer: health.HealthServicer,
        sweeper: HandleSweeper,
        port: int,
    ) -> None:
        super().__init__(server, servicer, health_servicer, port)
        self.sweeper = sweeper

    @property
    def deps(self) -> EngineDeps:
        return self.servicer.deps

    def stop(self, grace: float | None = 2.0, *, shutdown_runner: bool = False) -> None:
        """Drain and stop (idempotent); returns once the server has stopped and handles are closed.
        ``shutdown_runner`` also stops the engine thread (the process is going away)."""

        def release() -> None:
            self.sweeper.stop()
            for r in self.deps.registry.release_all():
                r.value.close()
            if shutdown_runner:
                self.deps.runner.shutdown()

        self._drain(grace, before=self.servicer.drain, after=release)


def create_server(
    deps: EngineDeps,
    address: str = "127.0.0.1:0",
    *,
    security: ServerSecurity | None = None,
    metrics: bool = False,
) -> tuple[EngineServer, int]:
    """Build, bind and start the engine server; returns it and the bound port. ``security``: TLS and/or
    bearer tokens (``engine_service/serving/auth.py``; None: plaintext, self-declared owners). ``metrics``:
    collect Prometheus metrics (``server.metrics``; served by ``server.start_metrics``)."""
    servicer = EngineServicer(deps)
    engine_metrics = EngineMetrics(deps) if metrics else None
    try:
        server, health_servicer, port = build_grpc_server(
            engine_pb2_grpc.add_EngineServicer_to_server,
            servicer,
            SERVICE_NAME,
            address,
            max_workers=MAX_WORKERS,
            thread_name_prefix="forkline-engine-rpc",
            security=security,
            interceptors=() if engine_metrics is None else (engine_metrics.interceptor,),
        )
    except BaseException:
        if engine_metrics is not None:
            engine_metrics.close()  # detach the runner's batch observer
        raise
    sweeper = HandleSweeper(deps)
    sweeper.start()
    log.info("engine serving %s on port %d (instance %s)", SERVICE_NAME, port, deps.registry.instance_id)
    engine_server = EngineServer(server, servicer, health_servicer, sweeper, port)
    engine_server.metrics = engine_metrics
    return engine_server, port
