"""The prefix-cache gRPC server: servicer + health checking + reflection.

``connect_engine(address, ...)`` builds the :class:`Gateway`: a channel to the engine, an
:class:`EngineBackend` that first releases whatever an earlier instance of this service left in the
engine (ReleaseOwner under its stable owner id), and the :class:`PrefixCache`.
``create_server(gateway, address)`` binds and starts serving. ``server.stop(grace)`` drains; with
``release=True`` it also releases every stored snapshot in the engine (a clean shutdown; a killed
service is cleaned up by its next start).

The engine channel reconnects with a capped backoff and the server watches the engine's health
(``prefix_service/rpc/engine_watch.py``): a restarted engine is noticed as soon as it serves, and this
service's own health reports its service NOT_SERVING while the engine is down ("" stays SERVING).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2

from engine_service.errors import FailedPrecondition, InvalidArgument, Unavailable
from engine_service.rpc.auth import ClientSecurity, ServerSecurity
from engine_service.rpc.service_main import GrpcServer, build_grpc_server
from prefix_service.budget import DEFAULT_ENGINE_SHARE
from prefix_service.gateway import Gateway
from prefix_service.prefix_cache import PrefixCache
from prefix_service.rpc.engine_backend import DEFAULT_OWNER, EngineBackend
from prefix_service.rpc.engine_watch import OUTAGE_WAIT_S, RECONNECT_OPTIONS, EngineWatch
from prefix_service.rpc.servicer import PrefixServicer
from protos import engine_pb2, prefix_pb2, prefix_pb2_grpc

if TYPE_CHECKING:  # the HTTP door is imported only when started
    from prefix_service.http.app import OwnerTable
    from prefix_service.http.server import HttpServer

log = logging.getLogger(__name__)

SERVICE_NAME = prefix_pb2.DESCRIPTOR.services_by_name["PrefixCache"].full_name
MAX_WORKERS = 64


def connect_engine(
    engine_address: str,
    *,
    max_entries: int = 64,
    policy: str = "lru",
    owner: str = DEFAULT_OWNER,
    ready_timeout: float = 30.0,
    engine_security: ClientSecurity | None = None,
    outage_wait_s: float = OUTAGE_WAIT_S,
    engine_share: float = DEFAULT_ENGINE_SHARE,
    max_positions: int = 0,
    pressure_retry: bool = True,
) -> tuple[Gateway, grpc.Channel]:
    """Connect to the engine, release this owner's leftovers there, and build the cache.
    ``engine_security``: this service's token for the engine and/or TLS to it (rpc/auth.py).
    ``outage_wait_s``: how long a call waits for the engine while it is down (engine_watch.py).
    ``engine_share``: the share of the engine's sessions and positions the cache may hold, within
    ``max_entries`` / ``max_positions`` (0: no own positions bound); see prefix_service/pressure.py.
    ``pressure_retry`` False: a live request is never retried after evicting (tests' control)."""
    engine_security = engine_security or ClientSecurity()
    channel = engine_security.channel(engine_address, RECONNECT_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=ready_timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        raise Unavailable(f"engine at {engine_address} not reachable within {ready_timeout} s") from None
    backend = EngineBackend(channel, owner=owner, token=engine_security.token)
    backend.watch = EngineWatch(channel, outage_wait_s=outage_wait_s)  # started by create_server
    if backend.refresh().persistent is False:
        channel.close()
        raise FailedPrecondition(
            f"the engine does not treat owner {owner!r} as a persistent owner: its snapshots would expire and "
            f"it could not hand lookup clones to its callers; start forkline-engine with --persistent_owner {owner}")
    released = backend.release_owned()
    if released:
        log.info("released %d snapshots an earlier %s left in the engine", released, owner)
    cache = PrefixCache(backend, max_entries, policy, max_positions=max_positions)
    gateway = Gateway(cache, backend, policy, engine_share=engine_share, pressure_retry=pressure_retry)
    gateway.check_engine()  # the budget from the engine's limits, before the first call
    return gateway, channel


class PrefixServer(GrpcServer):
    """A running prefix-cache server. ``port`` is the bound port."""

    servicer: PrefixServicer

    def __init__(self, server: grpc.Server, servicer: PrefixServicer, health_servicer: health.HealthServicer,
                 port: int, channel: grpc.Channel | None) -> None:
        super().__init__(server, servicer, health_servicer, port)
        self.channel = channel  # to the engine; closed when this server stops

    @property
    def gateway(self) -> Gateway:
        return self.servicer.gateway

    deps = gateway  # the name the service fixtures and benches use

    http: HttpServer | None = None  # the OpenAI-compatible HTTP door, when started

    def start_http(self, host: str, port: int, *, model_name: str = "", auth: OwnerTable | None = None,
                   tls_cert: str | None = None, tls_key: str | None = None,
                   tls_client_ca: str | None = None) -> int:
        """Serve the OpenAI-compatible HTTP door (``prefix_service/http``) in this process over this
        server's gateway; returns its bound port. ``model_name`` "": the engine's model file name.
        ``auth``: bearer tokens -> owners (as the gRPC side's token table). It stops with this server."""
        from prefix_service.http.app import create_app, served_model_name
        from prefix_service.http.server import HttpServer

        if not model_name:
            backend = self.gateway.backend
            if not isinstance(backend, EngineBackend):
                raise InvalidArgument("model_name is required for a gateway without a remote engine")
            model_name = served_model_name(backend.call(backend.stub.Info, engine_pb2.InfoRequest()).model)
        app = create_app(self.gateway, model_name=model_name, auth=auth)
        self.http = HttpServer.start(app, host, port, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca)
        return self.http.port

    @property
    def engine_watch(self) -> EngineWatch | None:
        """The engine's health watch (None for a gateway without a remote engine)."""
        backend = self.gateway.backend
        return backend.watch if isinstance(backend, EngineBackend) else None

    @property
    def engine_serving(self) -> bool:
        """Whether the engine reports SERVING now, as far as the watch knows."""
        watch = self.engine_watch
        return watch is None or watch.serving

    def watch_engine(self) -> None:
        """Follow the engine's health: when it serves again, check it for a restart (dropping the dead
        instance's entries without waiting for a call); meanwhile report this service NOT_SERVING."""
        watch = self.engine_watch
        if watch is None:
            return
        status = health_pb2.HealthCheckResponse

        def on_change(serving: bool) -> None:
            self.health.set(SERVICE_NAME, status.SERVING if serving else status.NOT_SERVING)

        watch.start(on_serving=self.gateway.check_engine, on_change=on_change)

    def stop(self, grace: float | None = 2.0, *, release: bool = True) -> None:
        """Drain and stop (idempotent). ``release``: close every stored snapshot in the engine.
        The HTTP door stops first (its requests finish or end within ``grace``)."""
        if self.http is not None:
            self.http.stop(grace)

        def cleanup() -> None:
            watch = self.engine_watch
            if release and watch is not None and not watch.serving:
                log.warning("engine down at shutdown: its restart or this service's next start releases the snapshots")
            elif release:
                try:
                    self.gateway.clear()
                except Exception:  # the engine may be gone already; its restart drops them anyway
                    log.warning("could not release snapshots at shutdown", exc_info=True)
            if watch is not None:
                watch.stop()
            if self.channel is not None:
                self.channel.close()

        self._drain(grace, after=cleanup)


def create_server(gateway: Gateway, address: str = "127.0.0.1:0", *, channel: grpc.Channel | None = None,
                  security: ServerSecurity | None = None, metrics: bool = False) -> tuple[PrefixServer, int]:
    """Build, bind and start the prefix server; returns it and the bound port. ``channel`` (the engine
    channel from :func:`connect_engine`) is closed when the server stops. ``security``: TLS and/or
    bearer tokens for this service's callers (None: plaintext, self-declared owners). ``metrics``:
    collect Prometheus metrics (``rpc/metrics.py``; served by ``server.start_metrics``)."""
    from prefix_service.rpc.metrics import PrefixMetrics

    servicer = PrefixServicer(gateway)
    prefix_metrics = PrefixMetrics(gateway) if metrics else None
    server, health_servicer, port = build_grpc_server(
        prefix_pb2_grpc.add_PrefixCacheServicer_to_server, servicer, SERVICE_NAME, address,
        max_workers=MAX_WORKERS, thread_name_prefix="forkline-prefix-rpc", security=security,
        interceptors=() if prefix_metrics is None else (prefix_metrics.interceptor,),
    )
    log.info("prefix cache serving %s on port %d (engine instance %s)", SERVICE_NAME, port,
             gateway.backend.instance_id)
    prefix_server = PrefixServer(server, servicer, health_servicer, port, channel)
    prefix_server.metrics = prefix_metrics
    prefix_server.watch_engine()
    return prefix_server, port
