"""What the fleet reports (``Fleet.stats()``): each engine's status and the engines' gateway stats summed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from prefix_service.cache.outcomes import PrefixStats
from prefix_service.fleet.member import EngineMember
from prefix_service.gateway.calls import GatewayStats
from prefix_service.gateway.inflight import JoinStats
from prefix_service.tier.snapshot_store import StoreStats


@dataclass(frozen=True)
class EngineStatus:
    """One engine in :class:`FleetStats`: its identity, whether requests are routed to it, its
    gateway's stats and its routing counters (``moves_in`` / ``moves_out``: snapshots moved to / from it;
    ``move_refusals``: moves to it that did not happen, by reason)."""

    name: str
    instance_id: str
    fingerprint: str
    routable: bool
    stats: GatewayStats
    in_flight: int
    load: int
    routed: int
    load_guarded: int
    moves_in: int = 0
    moves_out: int = 0
    move_refusals: dict[str, int] = field(default_factory=dict)


def engine_status(member: EngineMember, routable: bool) -> EngineStatus:
    return EngineStatus(
        member.name,
        member.gateway.instance_id,
        member.fingerprint,
        routable,
        member.gateway.stats(),
        member.in_flight,
        member.load,
        member.routed,
        member.load_guarded,
        member.moves_in,
        member.moves_out,
        dict(member.move_refusals),
    )


@dataclass(frozen=True)
class FleetStats:
    """``total``: the engines' gateway stats summed (instance id, policy and share: the first
    engine's); ``routing``: the policy's name; ``engines``: each engine; ``routes``: route decisions
    by reason (``routing.RouteReason`` values)."""

    total: GatewayStats
    routing: str
    engines: tuple[EngineStatus, ...]
    routes: dict[str, int]
    snapshot_dir: StoreStats | None = None  # the persistent tier, when there is one


def summed(stats: Sequence[GatewayStats]) -> GatewayStats:
    """Gateway stats added up over engines (identity fields: the first engine's)."""
    if not stats:
        empty = PrefixStats(0, 0, 0, 0, 0, 0, 0)
        return GatewayStats(empty, 0, "", "")
    if len(stats) == 1:
        return stats[0]
    refusals: Counter[str] = Counter()
    misses: Counter[str] = Counter()
    for s in stats:
        refusals.update(s.cache.refusals)
        misses.update(s.misses_by_reason)
    cache = PrefixStats(
        **{
            f.name: sum(getattr(s.cache, f.name) for s in stats)
            for f in fields(PrefixStats)
            if f.name != "refusals"
        },
        refusals=dict(refusals),
    )
    first = stats[0]
    return replace(
        first,
        cache=cache,
        dropped_on_restart=sum(s.dropped_on_restart for s in stats),
        pressure_evictions=sum(s.pressure_evictions for s in stats),
        pressure_retries=sum(s.pressure_retries for s in stats),
        reclaimed=sum(s.reclaimed for s in stats),
        misses_by_reason=dict(misses),
        joins=summed_joins([s.joins for s in stats]),
    )


def summed_joins(stats: Sequence[JoinStats]) -> JoinStats:
    return JoinStats(**{f.name: sum(getattr(s, f.name) for s in stats) for f in fields(JoinStats)})
