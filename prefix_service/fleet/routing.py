"""Routing policies chosen by name (``--routing``): ``cost`` (``cost_model.py``), ``cache_aware`` (the most
reuse unless over the two-sided load guard), ``least_loaded``, ``round_robin``; each orders the
``route.Candidate``s. Spec: docs/ROUTING.md#routing-policies---routing."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

from engine_service.api.errors import InvalidArgument
from prefix_service.fleet.cost_model import CostConfig, CostModel
from prefix_service.fleet.route import (
    Candidate,
    Move,
    Route,
    RouteReason,
    RouteRequest,
    RoutingPolicy,
    by_load,
    checked,
)

__all__ = [
    "Candidate",
    "Move",
    "Route",
    "RouteReason",
    "RouteRequest",
    "RoutingPolicy",
    "routing_names",
    "routing_policy",
]

DEFAULT_ROUTING = CostModel.name
DEFAULT_IMBALANCE_ABS = 4
DEFAULT_IMBALANCE_REL = 1.5


class CacheAware:
    """See the module docstring. ``imbalance_abs`` >= 0 requests, ``imbalance_rel`` >= 1."""

    name = "cache_aware"

    def __init__(
        self, imbalance_abs: int = DEFAULT_IMBALANCE_ABS, imbalance_rel: float = DEFAULT_IMBALANCE_REL
    ) -> None:
        if imbalance_abs < 0:
            raise InvalidArgument(f"imbalance_abs must be >= 0, got {imbalance_abs}")
        if not imbalance_rel >= 1:
            raise InvalidArgument(f"imbalance_rel must be >= 1, got {imbalance_rel}")
        self.imbalance_abs, self.imbalance_rel = imbalance_abs, imbalance_rel

    def overloaded(self, load: int, least: int) -> bool:
        """Whether an engine at ``load`` is too busy next to one at ``least``."""
        return load - least > self.imbalance_abs and load > self.imbalance_rel * least

    def route(self, candidates: Sequence[Candidate], request: RouteRequest | None = None) -> Route:
        ordered = by_load(checked(candidates))
        best = min(candidates, key=lambda c: (-c.reusable, c.load, c.name))
        if best.reusable == 0:
            return Route(tuple(ordered), RouteReason.MISS)
        if self.overloaded(best.load, ordered[0].load):
            return Route(tuple(ordered), RouteReason.LOAD_GUARD)
        return Route((best, *(c for c in ordered if c is not best)), RouteReason.CACHE)


class LeastLoaded:
    name = "least_loaded"

    def route(self, candidates: Sequence[Candidate], request: RouteRequest | None = None) -> Route:
        return Route(tuple(by_load(checked(candidates))), RouteReason.LOAD)


class RoundRobin:
    """Engines in turn, by name order; the fallbacks are the engines after it."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def route(self, candidates: Sequence[Candidate], request: RouteRequest | None = None) -> Route:
        ordered = sorted(checked(candidates), key=lambda c: c.name)
        with self._lock:
            start = next(self._turn) % len(ordered)
        return Route(tuple(ordered[start:] + ordered[:start]), RouteReason.TURN)


_POLICIES: dict[str, Callable[..., RoutingPolicy]] = {
    CostModel.name: CostModel,
    CacheAware.name: CacheAware,
    LeastLoaded.name: LeastLoaded,
    RoundRobin.name: RoundRobin,
}


def routing_names() -> list[str]:
    return list(_POLICIES)


def routing_policy(
    name: str,
    *,
    imbalance_abs: int = DEFAULT_IMBALANCE_ABS,
    imbalance_rel: float = DEFAULT_IMBALANCE_REL,
    cost: CostConfig | None = None,
) -> RoutingPolicy:
    """The policy called ``name`` (InvalidArgument naming the choices otherwise); the imbalance
    knobs apply to ``cache_aware``, ``cost`` to ``cost``."""
    if name == CacheAware.name:
        return CacheAware(imbalance_abs, imbalance_rel)
    if name == CostModel.name:
        return CostModel(cost)
    factory = _POLICIES.get(name)
    if factory is None:
        raise InvalidArgument(f"routing: unknown policy {name!r}; one of {', '.join(_POLICIES)}")
    return factory()
