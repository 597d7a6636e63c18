"""The engine gRPC server: servicer, health (with the engine thread's heartbeat), reflection, the idle
handle sweeper; ``stop(grace)`` drains. The runner belongs to the caller."""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health

from engine_service.rpc.metrics import EngineMetrics
from engine_service.rpc.servicer import EngineServicer
from engine_service.runtime.heartbeat import DEFAULT_STUCK_AFTER_S, EngineHeartbeat
from engine_service.serving.auth import ServerSecurity
from engine_service.serving.drain import InFlight
from engine_service.serving.grpc_server import GrpcServer, build_grpc_server
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.sweeper import HandleSweeper
from protos import engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
MAX_WORKERS = 64  # each streaming Generate holds a worker thread for its duration


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
        *,
        in_flight: InFlight | None = None,
        stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
    ) -> None:
        super().__init__(server, servicer, health_servicer, port, service=SERVICE_NAME, in_flight=in_flight)
        self.sweeper = sweeper
        self.heartbeat = EngineHeartbeat(
            self.deps.runner,
            lambda alive: self.health_state.update(alive=alive),
            stuck_after_s=stuck_after_s,
        )
        self.deps.heartbeat = self.heartbeat
        self.heartbeat.start()

    @property
    def deps(self) -> EngineSessions:
        """The sessions this server serves."""
        return self.servicer.sessions

    def stop(self, grace: float | None = 2.0, *, shutdown_runner: bool = False) -> None:
        """Drain: new work UNAVAILABLE, the rest gets ``grace`` s; then close every handle (idempotent).
        ``shutdown_runner`` also stops the engine thread."""

        def release() -> None:
            self.heartbeat.stop()
            self.sweeper.stop()
            self.deps.release_all()
            if shutdown_runner:
                self.deps.runner.shutdown()

        self._drain(grace, before=self.deps.drain, after=release)


def create_server(
    sessions: EngineSessions,
    address: str = "127.0.0.1:0",
    *,
    security: ServerSecurity | None = None,
    metrics: bool = False,
    stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
) -> tuple[EngineServer, int]:
    """Build, bind and start the engine server: (server, bound port). ``security`` None: plaintext,
    self-declared owners; ``stuck_after_s``: the heartbeat's."""
    servicer = EngineServicer(sessions)
    in_flight = InFlight()  # new work is refused by the sessions' drain, everything else is served
    engine_metrics = EngineMetrics(sessions) if metrics else None
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
            in_flight=in_flight,
        )
    except BaseException:
        if engine_metrics is not None:
            engine_metrics.close()  # detach the runner's batch observer
        raise
    sweeper = HandleSweeper(sessions.registry)
    sweeper.start()
    log.info("engine serving %s on port %d (instance %s)", SERVICE_NAME, port, sessions.registry.instance_id)
    engine_server = EngineServer(
        server, servicer, health_servicer, sweeper, port, in_flight=in_flight, stuck_after_s=stuck_after_s
    )
    engine_server.metrics = engine_metrics
    return engine_server, port
