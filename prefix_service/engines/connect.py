"""How the prefix service reaches its engines: :func:`open_engine` (connect, read Info: who the engine is)
then :func:`join_engine` (release what an earlier instance of this service left, build the cache and
gateway), both in :func:`connect_engine`; :func:`connect_fleet` does so for every engine the targets
name, as they come and go (``engine_pool.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from engine_service.api.engine_info import EngineInfo
from engine_service.api.errors import FailedPrecondition, Unavailable
from engine_service.api.owners import PERSISTENT_OWNER
from engine_service.serving.auth import ClientSecurity
from prefix_service.cache.budget import DEFAULT_ENGINE_SHARE, DEFAULT_MAX_ENTRIES
from prefix_service.cache.checkpoints import CheckpointPlan
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.engines.engine_backend import EngineBackend
from prefix_service.engines.engine_calls import EngineCalls
from prefix_service.engines.engine_pool import (
    DEFAULT_LEAVE_AFTER_S,
    DEFAULT_RESOLVE_EVERY_S,
    EnginePool,
    RemoteMember,
)
from prefix_service.engines.engine_watch import OUTAGE_WAIT_S, RECONNECT_OPTIONS, EngineWatch
from prefix_service.fleet.fleet import Fleet
from prefix_service.fleet.member import EngineMember
from prefix_service.fleet.routing import RoutingPolicy
from prefix_service.gateway.gateway import Gateway
from prefix_service.gateway.inflight import JoinConfig
from prefix_service.tier.persistent_tier import PersistentTier

log = logging.getLogger(__name__)


@dataclass
class OpenedEngine:
    """An engine connected at ``address`` whose Info was read, not yet serving this service (the pool
    reads ``info`` first: a known instance is an alias, a draining engine is not joined)."""

    address: str
    channel: grpc.Channel
    engine: EngineBackend
    info: EngineInfo

    def close(self) -> None:
        self.channel.close()


def open_engine(
    engine_address: str,
    *,
    owner: str = PERSISTENT_OWNER,
    ready_timeout: float = 30.0,
    engine_security: ClientSecurity | None = None,
    outage_wait_s: float = OUTAGE_WAIT_S,
) -> OpenedEngine:
    """Connect and read the engine's Info; Unavailable when it does not answer within ``ready_timeout``,
    FailedPrecondition when it does not treat ``owner`` as a persistent owner. Releases nothing."""
    engine_security = engine_security or ClientSecurity()
    channel = engine_security.channel(engine_address, RECONNECT_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=ready_timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        raise Unavailable(f"engine at {engine_address} not reachable within {ready_timeout} s") from None
    engine = EngineBackend.connect(channel, owner=owner, token=engine_security.token)
    engine.connection.address = engine_address
    try:
        info = engine.connection.refresh()
    except BaseException:
        channel.close()
        raise
    if (caller := info.caller) is not None and not caller.persistent:
        channel.close()
        raise FailedPrecondition(
            f"the engine does not treat owner {owner!r} as a persistent owner: its snapshots would expire and "
            f"it could not hand lookup clones to its callers; start forkline-engine with --persistent_owner {owner} "
            "(or --persistent_owner_prefix)"
        )
    engine.connection.watch = EngineWatch(channel, outage_wait_s=outage_wait_s)  # started with the server
    return OpenedEngine(engine_address, channel, engine, info)


def join_engine(
    opened: OpenedEngine,
    *,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    policy: str = "lru",
    engine_share: float = DEFAULT_ENGINE_SHARE,
    max_positions: int = 0,
    max_cache_mib: int = 0,
    pressure_retry: bool = True,
    tier: PersistentTier | None = None,
    checkpoints: CheckpointPlan | None = None,
    cache_generated: bool = True,
    checkpoint_every: int = 0,
    joins: JoinConfig | None = None,
) -> Gateway:
    """Release what an earlier instance of this owner left in the opened engine and build its cache and
    gateway (see :func:`connect_engine` for the arguments)."""
    calls = opened.engine.calls
    released = calls.release_owned()
    if released:
        log.info("released %d snapshots an earlier %s left in the engine", released, calls.owner)
    cache = PrefixCache(calls.sessions, max_entries, policy, max_positions=max_positions)
    gateway = Gateway(
        cache,
        calls,
        policy,
        engine_share=engine_share,
        pressure_retry=pressure_retry,
        tier=tier,
        checkpoints=checkpoints,
        max_cache_mib=max_cache_mib,
        cache_generated=cache_generated,
        checkpoint_every=checkpoint_every,
        joins=joins,
    )
    gateway.check_engine()  # the budget from the engine's limits, before the first call
    gateway.preload()  # --snapshot_preload: restore recent snapshot files in the background
    return gateway


def connect_engine(
    engine_address: str,
    *,
    owner: str = PERSISTENT_OWNER,
    ready_timeout: float = 30.0,
    engine_security: ClientSecurity | None = None,
    outage_wait_s: float = OUTAGE_WAIT_S,
    **cache: Any,
) -> tuple[Gateway, grpc.Channel]:
    """:func:`open_engine` then :func:`join_engine` (``cache``: its keyword arguments, as ``Gateway``'s);
    ``engine_security``: this service's token and TLS for the engine; ``outage_wait_s``: how long a
    call waits for a down engine."""
    opened = open_engine(
        engine_address,
        owner=owner,
        ready_timeout=ready_timeout,
        engine_security=engine_security,
        outage_wait_s=outage_wait_s,
    )
    try:
        return join_engine(opened, **cache), opened.channel
    except BaseException:
        opened.close()
        raise


def remote_member(gateway: Gateway, channel: grpc.Channel | None) -> RemoteMember:
    """A fleet member over ``connect_engine``'s gateway; leaving the fleet closes its watch and channel."""
    backend = gateway.backend
    connection = backend.connection if isinstance(backend, EngineCalls) else None
    watch = connection.watch if connection is not None else None
    name = (connection.address if connection is not None else "") or "engine"

    def close() -> None:
        if watch is not None:
            watch.stop()
        if channel is not None:
            channel.close()

    return RemoteMember(name, gateway, watch, close, connection)


_OPEN_ARGUMENTS = ("owner", "engine_security", "outage_wait_s")  # open_engine's; the rest are join_engine's


def connect_fleet(
    targets: Callable[[], set[str]],
    *,
    policy: RoutingPolicy | None = None,
    policy_name: str = "lru",
    ready_timeout: float = 30.0,
    resolve_every_s: float = DEFAULT_RESOLVE_EVERY_S,
    leave_after_s: float = DEFAULT_LEAVE_AFTER_S,
    tier: PersistentTier | None = None,
    **connect: Any,
) -> tuple[Fleet, EnginePool]:
    """The engines ``targets()`` names in a routed fleet (waits up to ``ready_timeout`` for one; the pool
    adds and removes them from then on). ``policy``: routing; ``policy_name``: every cache's retention;
    ``connect``: :func:`connect_engine`'s other keyword arguments."""
    fleet = Fleet(policy=policy)
    fleet.tier = tier
    opening = {k: v for k, v in connect.items() if k in _OPEN_ARGUMENTS}
    joining = {k: v for k, v in connect.items() if k not in _OPEN_ARGUMENTS}

    def open_at(address: str, timeout: float) -> OpenedEngine:
        return open_engine(address, ready_timeout=timeout, **opening)

    def join(opened: OpenedEngine) -> EngineMember:
        try:
            gateway = join_engine(opened, policy=policy_name, tier=tier, **joining)
        except BaseException:
            opened.close()
            raise
        return remote_member(gateway, opened.channel)

    pool = EnginePool(
        fleet, targets, open_at, join, resolve_every_s=resolve_every_s, leave_after_s=leave_after_s
    )
    pool.start_serving(ready_timeout)
    return fleet, pool
