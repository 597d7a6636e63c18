"""The prefix-cache gRPC server: servicer + health checking + reflection.

``connect_engine(address, ...)`` builds one engine's :class:`Gateway`: a channel to the engine, an
:class:`EngineBackend` that first releases whatever an earlier instance of this service left in the
engine (ReleaseOwner under its stable owner id), and the :class:`PrefixCache`. ``connect_fleet(targets,
...)`` does that for every engine the targets name, now and as they come and go
(``rpc/engine_pool.py``), in a :class:`Fleet` that routes each request (``prefix_service/fleet.py``).
``create_server(gateway_or_fleet, address)`` binds and starts serving. ``server.stop(grace)`` drains; with
``release=True`` it also releases every stored snapshot in the engine (a clean shutdown; a killed
service is cleaned up by its next start).

The engine channel reconnects with a capped backoff and the server watches the engine's health
(``prefix_service/rpc/engine_watch.py``): a restarted engine is noticed as soon as it serves, and this
service's own health reports its service NOT_SERVING while no engine serves ("" stays SERVING).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2

from engine_service.api.errors import FailedPrecondition, InvalidArgument, Unavailable
from engine_service.api.owners import PERSISTENT_OWNER
from engine_service.serving.auth import ClientSecurity, ServerSecurity
from engine_service.serving.grpc_server import GrpcServer, build_grpc_server
from prefix_service.cache.budget import DEFAULT_ENGINE_SHARE
from prefix_service.cache.checkpoints import CheckpointPlan
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.fleet import EngineMember, Fleet
from prefix_service.gateway.gateway import Gateway
from prefix_service.routing import RoutingPolicy
from prefix_service.rpc.engine_backend import EngineBackend
from prefix_service.rpc.engine_pool import DEFAULT_RESOLVE_EVERY_S, EnginePool, RemoteMember
from prefix_service.rpc.engine_watch import OUTAGE_WAIT_S, RECONNECT_OPTIONS, EngineWatch
from prefix_service.rpc.servicer import PrefixServicer
from prefix_service.tier.persistent_tier import PersistentTier
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
    owner: str = PERSISTENT_OWNER,
    ready_timeout: float = 30.0,
    engine_security: ClientSecurity | None = None,
    outage_wait_s: float = OUTAGE_WAIT_S,
    engine_share: float = DEFAULT_ENGINE_SHARE,
    max_positions: int = 0,
    pressure_retry: bool = True,
    tier: PersistentTier | None = None,
    checkpoints: CheckpointPlan | None = None,
) -> tuple[Gateway, grpc.Channel]:
    """Connect to the engine, release this owner's leftovers there, and build the cache.
    ``engine_security``: this service's token for the engine and/or TLS to it (engine_service/serving/auth.py).
    ``outage_wait_s``: how long a call waits for the engine while it is down (engine_watch.py).
    ``engine_share``: the share of the engine's sessions and positions the cache may hold, within
    ``max_entries`` / ``max_positions`` (0: no own positions bound); see prefix_service/gateway/pressure.py.
    ``pressure_retry`` False: a live request is never retried after evicting (tests' control).
    ``tier``: the snapshot directory shared by every engine's gateway (``persistent_tier.py``).
    ``checkpoints``: where captures take checkpoints inside a prompt on a sliding-window engine
    (``checkpoints.py``; default: every 256 positions and at message ends, at most 8)."""
    engine_security = engine_security or ClientSecurity()
    channel = engine_security.channel(engine_address, RECONNECT_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=ready_timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        raise Unavailable(f"engine at {engine_address} not reachable within {ready_timeout} s") from None
    backend = EngineBackend(channel, owner=owner, token=engine_security.token)
    backend.address = engine_address
    backend.watch = EngineWatch(channel, outage_wait_s=outage_wait_s)  # started by create_server
    if (caller := backend.refresh().caller) is not None and not caller.persistent:
        channel.close()
        raise FailedPrecondition(
            f"the engine does not treat owner {owner!r} as a persistent owner: its snapshots would expire and "
            f"it could not hand lookup clones to its callers; start forkline-engine with --persistent_owner {owner}"
        )
    released = backend.release_owned()
    if released:
        log.info("released %d snapshots an earlier %s left in the engine", released, owner)
    cache = PrefixCache(backend, max_entries, policy, max_positions=max_positions)
    gateway = Gateway(
        cache,
        backend,
        policy,
        engine_share=engine_share,
        pressure_retry=pressure_retry,
        tier=tier,
        checkpoints=checkpoints,
    )
    gateway.check_engine()  # the budget from the engine's limits, before the first call
    gateway.preload()  # --snapshot_preload: restore recent snapshot files in the background
    return gateway, channel


def remote_member(gateway: Gateway, channel: grpc.Channel | None) -> RemoteMember:
    """A fleet member over ``connect_engine``'s gateway; leaving the fleet closes its watch and channel."""
    backend = gateway.backend
    watch = backend.watch if isinstance(backend, EngineBackend) else None
    name = getattr(backend, "address", "") or "engine"

    def close() -> None:
        if watch is not None:
            watch.stop()
        if channel is not None:
            channel.close()

    return RemoteMember(name, gateway, watch, close)


def connect_fleet(
    targets: Callable[[], set[str]],
    *,
    policy: RoutingPolicy | None = None,
    policy_name: str = "lru",
    ready_timeout: float = 30.0,
    resolve_every_s: float = DEFAULT_RESOLVE_EVERY_S,
    tier: PersistentTier | None = None,
    **connect: Any,
) -> tuple[Fleet, EnginePool]:
    """The engines ``targets()`` names (``rpc/engine_pool.engine_targets``) in a routed fleet: waits up
    to ``ready_timeout`` for at least one; the pool adds and removes engines from then on (started
    with the server). ``policy``: the routing policy; ``policy_name``: the retention policy of every
    engine's cache; ``tier``: the snapshot directory they share. ``connect``: :func:`connect_engine`'s
    other keyword arguments for every engine."""
    fleet = Fleet(policy=policy)
    fleet.tier = tier

    def join(address: str, timeout: float) -> EngineMember:
        gateway, channel = connect_engine(
            address, ready_timeout=timeout, policy=policy_name, tier=tier, **connect
        )
        return remote_member(gateway, channel)

    pool = EnginePool(fleet, targets, join, resolve_every_s=resolve_every_s)
    pool.start_serving(ready_timeout)
    return fleet, pool


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
    ) -> None:
        super().__init__(server, servicer, health_servicer, port)
        self.pool = pool  # keeps the fleet in step with its targets; stopped with this server

    @property
    def fleet(self) -> Fleet:
        return self.servicer.gateway

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
    ) -> int:
        """Serve the OpenAI-compatible HTTP door (``prefix_service/http``) in this process over this
        server's fleet; returns its bound port. ``model_name`` "": the engines' model file name.
        ``auth``: bearer tokens -> owners (as the gRPC side's token table). It stops with this server."""
        from prefix_service.http.app import create_app, served_model_name
        from prefix_service.http.server import HttpServer

        if not model_name:
            backends = [m.gateway.backend for m in self.fleet.members()]
            backend = next((b for b in backends if isinstance(b, EngineBackend)), None)
            if backend is None:
                raise InvalidArgument("model_name is required for a gateway without a remote engine")
            model_name = served_model_name(backend.call(backend.stub.Info, engine_pb2.InfoRequest()).model)
        app = create_app(self.fleet, model_name=model_name, auth=auth)
        self.http = HttpServer.start(
            app, host, port, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca
        )
        return self.http.port

    @property
    def engine_watch(self) -> EngineWatch | None:
        """The only engine's health watch (None for a gateway without a remote engine)."""
        backend = self.gateway.backend
        return backend.watch if isinstance(backend, EngineBackend) else None

    @property
    def engine_serving(self) -> bool:
        """Whether some engine reports SERVING now, as far as the watches know."""
        return any(m.serving for m in self.fleet.members())

    def watch_engines(self) -> None:
        """Follow every engine's health (also those that join later): when one serves again, check it
        for a restart (dropping the dead instance's entries without waiting for a call); report this
        service NOT_SERVING while no engine serves."""
        for member in self.fleet.members():
            self._watch(member)
        if self.pool is not None:
            self.pool.on_join = self._watch

    def _watch(self, member: EngineMember) -> None:
        watch = getattr(member, "watch", None)
        if watch is None:
            return
        watch.start(on_serving=member.gateway.check_engine, on_change=lambda serving: self._health_changed())

    def _health_changed(self) -> None:
        status = health_pb2.HealthCheckResponse
        self.health.set(SERVICE_NAME, status.SERVING if self.engine_serving else status.NOT_SERVING)

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

        self._drain(grace, after=cleanup)


def create_server(
    gateway: Gateway | Fleet,
    address: str = "127.0.0.1:0",
    *,
    channel: grpc.Channel | None = None,
    pool: EnginePool | None = None,
    security: ServerSecurity | None = None,
    metrics: bool = False,
) -> tuple[PrefixServer, int]:
    """Build, bind and start the prefix server; returns it and the bound port. ``gateway``: one
    engine's gateway (``connect_engine``; its ``channel`` is closed when the server stops) or a fleet
    (``connect_fleet``, with its ``pool``). ``security``: TLS and/or bearer tokens for this service's
    callers (None: plaintext, self-declared owners). ``metrics``: collect Prometheus metrics
    (``rpc/metrics.py``; served by ``server.start_metrics``)."""
    from prefix_service.rpc.metrics import PrefixMetrics

    fleet = gateway if isinstance(gateway, Fleet) else Fleet([remote_member(gateway, channel)])
    servicer = PrefixServicer(fleet)
    prefix_metrics = PrefixMetrics(fleet) if metrics else None
    server, health_servicer, port = build_grpc_server(
        prefix_pb2_grpc.add_PrefixCacheServicer_to_server,
        servicer,
        SERVICE_NAME,
        address,
        max_workers=MAX_WORKERS,
        thread_name_prefix="forkline-prefix-rpc",
        security=security,
        interceptors=() if prefix_metrics is None else (prefix_metrics.interceptor,),
    )
    log.info(
        "prefix cache serving %s on port %d (engines: %s; routing %s)",
        SERVICE_NAME,
        port,
        ", ".join(f"{m.name} instance {m.gateway.backend.instance_id}" for m in fleet.members()),
        fleet.policy.name,
    )
    prefix_server = PrefixServer(server, servicer, health_servicer, port, pool)
    prefix_server.metrics = prefix_metrics
    prefix_server.watch_engines()
    return prefix_server, port
