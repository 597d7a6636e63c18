"""The prefix-cache gRPC server over a fleet of engines: servicer, health, reflection, optionally metrics
and the HTTP door. It follows every engine's health watch (NOT_SERVING while no engine serves); ``stop``
drains (new Lookup / Insert / Generate UNAVAILABLE at once, running streams get ``grace``) and releases
every stored snapshot in the engines."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health

from engine_service.api.errors import InvalidArgument
from engine_service.serving.auth import ServerSecurity
from engine_service.serving.drain import InFlight
from engine_service.serving.grpc_server import GrpcServer, build_grpc_server
from prefix_service.engines.connect import remote_member
from prefix_service.engines.engine_pool import EnginePool, RemoteMember
from prefix_service.engines.engine_watch import EngineWatch
from prefix_service.fleet.fleet import Fleet
from prefix_service.fleet.member import EngineMember
from prefix_service.gateway.gateway import Gateway
from prefix_service.gateway.tenancy import Tenancy
from prefix_service.rpc.servicer import PrefixServicer
from protos import prefix_pb2, prefix_pb2_grpc

if TYPE_CHECKING:  # the HTTP door is imported only when started
    from prefix_service.http.app import OwnerTable
    from prefix_service.http.server import HttpServer

log = logging.getLogger(__name__)

SERVICE_NAME = prefix_pb2.DESCRIPTOR.services_by_name["PrefixCache"].full_name
MAX_WORKERS = 64
NEW_WORK = tuple(f"/{SERVICE_NAME}/{m}" for m in ("Lookup", "Insert", "Generate"))  # refused while draining


class PrefixServer(GrpcServer):
    """A running prefix-cache server over a :class:`Fleet` of engines. ``port`` is the bound port."""

    servicer: PrefixServicer

    def __init__(
        self,
        server: grpc.Server,
        servicer: PrefixServicer,
        health_servicer: health.HealthServicer,
        port: int,
        pool: EnginePool | None,
        in_flight: InFlight | None = None,
    ) -> None:
        super().__init__(server, servicer, health_servicer, port, service=SERVICE_NAME, in_flight=in_flight)
        self.pool = pool  # keeps the fleet in step with its targets; stopped with this server

    @property
    def fleet(self) -> Fleet:
        return self.servicer.fleet

    @property
    def gateway(self) -> Gateway:
        """The only engine's gateway (InvalidArgument when the service routes to several)."""
        return self.fleet.sole()

    deps = gateway  # the name the service fixtures and benches use

    http: HttpServer | None = None  # the OpenAI-compatible HTTP door, when started

    def start_http(
        self,
        host: str,
        port: int,
        *,
        model_name: str = "",
        auth: OwnerTable | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
        namespace: str = "",
    ) -> int:
        """Serve the OpenAI-compatible HTTP door over this server's fleet (``create_app``; stopped with
        this server); its bound port. ``model_name`` "": the engines' model file name."""
        from prefix_service.http.app import create_app, served_model_name
        from prefix_service.http.server import HttpServer

        if not model_name:
            remote = next((m for m in self.fleet.members() if isinstance(m, RemoteMember)), None)
            if remote is None:
                raise InvalidArgument("model_name is required for a gateway without a remote engine")
            model_name = served_model_name(remote.model())
        app = create_app(
            self.fleet, model_name=model_name, auth=auth, tenancy=self.servicer.tenancy, namespace=namespace
        )
        self.http = HttpServer.start(
            app, host, port, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca
        )
        return self.http.port

    @property
    def engine_watch(self) -> EngineWatch | None:
        """The only engine's health watch (None for a gateway without a remote engine)."""
        self.fleet.sole()  # InvalidArgument with several engines
        return getattr(self.fleet.members()[0], "watch", None)

    @property
    def engine_serving(self) -> bool:
        """Whether some engine reports SERVING now, as far as the watches know."""
        return any(m.serving for m in self.fleet.members())

    def watch_engines(self) -> None:
        """Follow every engine's health, also of those that join later: one that serves again is checked
        for a restart at once; this service is NOT_SERVING while no engine serves."""
        for member in self.fleet.members():
            self._watch(member)
        if self.pool is not None:
            self.pool.on_join = self._watch

    def _watch(self, member: EngineMember) -> None:
        self.servicer.follow(member)  # its cache events (a member that joins later too)
        watch = getattr(member, "watch", None)
        if watch is None:
            return
        watch.start(on_serving=member.gateway.check_engine, on_change=lambda serving: self._health_changed())

    def _health_changed(self) -> None:
        self.health_state.update(ready=self.engine_serving)  # a draining service stays NOT_SERVING

    def stop(self, grace: float | None = 2.0, *, release: bool = True) -> None:
        """Drain and stop (idempotent). ``release``: close every stored snapshot in the engines.
        The HTTP door stops first (its requests finish or end within ``grace``)."""
        if self.http is not None:
            self.http.stop(grace)

        def cleanup() -> None:
            if self.pool is not None:
                self.pool.stop()
            tier = self.fleet.tier
            if tier is not None:  # what is queued is written first (the snapshots are still held)
                tier.writer.flush(10.0 if grace is None else grace)
                tier.stop()
            for member in self.fleet.members():
                if release and not member.serving:
                    log.warning(
                        "engine %s down at shutdown: its restart or this service's next start releases "
                        "the snapshots",
                        member.name,
                    )
                elif release:
                    try:
                        member.gateway.clear()
                    except Exception:  # the engine may be gone already; its restart drops them anyway
                        log.warning("could not release snapshots at shutdown", exc_info=True)
                member.close()

        self._drain(grace, after=cleanup, before=self.servicer.events.close)  # event streams end first


def create_server(
    gateway: Gateway | Fleet,
    address: str = "127.0.0.1:0",
    *,
    channel: grpc.Channel | None = None,
    pool: EnginePool | None = None,
    security: ServerSecurity | None = None,
    metrics: bool = False,
    tenancy: Tenancy | None = None,
) -> tuple[PrefixServer, int]:
    """Build, bind and start the prefix server: (server, bound port). ``gateway``: one engine's gateway
    (``connect_engine``; ``channel`` closed with the server) or a fleet (``connect_fleet`` and its
    ``pool``); ``security``: TLS and / or tokens (None: plaintext, self-declared owners)."""
    from prefix_service.rpc.metrics import PrefixMetrics

    fleet = gateway if isinstance(gateway, Fleet) else Fleet([remote_member(gateway, channel)])
    servicer = PrefixServicer(fleet, tenancy)
    prefix_metrics = PrefixMetrics(fleet) if metrics else None
    if prefix_metrics is not None and pool is not None:
        from prefix_service.engines.pool_metrics import PoolCollector

        prefix_metrics.registry.register(PoolCollector(pool))
    in_flight = InFlight(refuse=NEW_WORK)
    server, health_servicer, port = build_grpc_server(
        prefix_pb2_grpc.add_PrefixCacheServicer_to_server,
        servicer,
        SERVICE_NAME,
        address,
        max_workers=MAX_WORKERS,
        thread_name_prefix="forkline-prefix-rpc",
        security=security,
        interceptors=() if prefix_metrics is None else (prefix_metrics.interceptor,),
        in_flight=in_flight,
    )
    log.info(
        "prefix cache serving %s on port %d (engines: %s; routing %s)",
        SERVICE_NAME,
        port,
        ", ".join(f"{m.name} instance {m.gateway.instance_id}" for m in fleet.members()),
        fleet.policy.name,
    )
    prefix_server = PrefixServer(server, servicer, health_servicer, port, pool, in_flight)
    prefix_server.metrics = prefix_metrics
    prefix_server.watch_engines()
    return prefix_server, port
