"""The prefix-cache gRPC server: servicer + health checking + reflection.

``connect_engine(address, ...)`` builds the deps: a channel to the engine, an :class:`EngineBackend`
that first releases whatever an earlier instance of this service left in the engine (ReleaseOwner
under its stable owner id), and the :class:`PrefixCache`. ``create_server(deps, address)`` binds and
starts serving. ``server.stop(grace)`` drains; with ``release=True`` it also releases every stored
snapshot in the engine (a clean shutdown; a killed service is cleaned up by its next start).
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefix_service.prefix_cache import PrefixCache
from prefix_service.rpc.engine_backend import DEFAULT_OWNER, EngineBackend
from prefix_service.rpc.servicer import PrefixDeps, PrefixServicer
from protos import prefix_pb2, prefix_pb2_grpc

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
) -> tuple[PrefixDeps, grpc.Channel]:
    """Connect to the engine, release this owner's leftovers there, and build the cache."""
    channel = grpc.insecure_channel(engine_address)
    try:
        grpc.channel_ready_future(channel).result(timeout=ready_timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        from engine_service.errors import Unavailable

        raise Unavailable(f"engine at {engine_address} not reachable within {ready_timeout} s") from None
    backend = EngineBackend(channel, owner=owner)
    backend.refresh()
    released = backend.release_owned()
    if released:
        log.info("released %d snapshots an earlier %s left in the engine", released, owner)
    return PrefixDeps(PrefixCache(backend, max_entries, policy), backend, policy), channel


class PrefixServer:
    def __init__(self, server: grpc.Server, servicer: PrefixServicer, health_servicer: health.HealthServicer,
                 port: int, channel: grpc.Channel | None) -> None:
        self.grpc_server = server
        self.servicer = servicer
        self.health = health_servicer
        self.port = port
        self.channel = channel
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    @property
    def deps(self) -> PrefixDeps:
        return self.servicer.deps

    def stop(self, grace: float | None = 2.0, *, release: bool = True) -> None:
        """Drain and stop (idempotent). ``release``: close every stored snapshot in the engine."""
        with self._lock:
            if self._stopped.is_set():
                return
            self.health.enter_graceful_shutdown()
            self.grpc_server.stop(grace).wait()
            if release:
                try:
                    self.deps.cache.clear()
                except Exception:  # the engine may be gone already; its restart drops them anyway
                    log.warning("could not release snapshots at shutdown", exc_info=True)
            if self.channel is not None:
                self.channel.close()
            self._stopped.set()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)


def create_server(deps: PrefixDeps, address: str = "127.0.0.1:0", *,
                  channel: grpc.Channel | None = None) -> tuple[PrefixServer, int]:
    """Build, bind and start the prefix server; returns it and the bound port. ``channel`` (the engine
    channel from :func:`connect_engine`) is closed when the server stops."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="forkline-prefix-rpc"),
        options=[("grpc.so_reuseport", 0)],
    )
    servicer = PrefixServicer(deps)
    prefix_pb2_grpc.add_PrefixCacheServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    server.start()
    log.info("prefix cache serving %s on port %d (engine instance %s)", SERVICE_NAME, port,
             deps.backend.instance_id)
    return PrefixServer(server, servicer, health_servicer, port, channel), port
