"""Routing policies: which engine serves a request, scored on exact cache placement and load.

A policy gets one :class:`Candidate` per routable engine (the positions its cache can reuse, its load:
this service's generations there plus the engine's own count as last read, the positions it holds)
and returns a :class:`Route`: every engine in the order to try them and why the first was chosen.
Chosen by name (``--routing``):

- ``cache_aware`` (default): the most reuse (ties: the least loaded), unless nothing is reused (a miss:
  the least loaded) or it is overloaded: its load exceeds the least loaded engine's by more than
  ``imbalance_abs`` and by a factor of more than ``imbalance_rel`` (SGLang's and vLLM's two-sided guard).
- ``least_loaded``: the least loaded (ties: the most reuse). ``round_robin``: in turn (a baseline).

Ties in load go to the engine holding the fewest positions, so misses spread new prefixes.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from engine_service.api.errors import InvalidArgument

DEFAULT_IMBALANCE_ABS = 4
DEFAULT_IMBALANCE_REL = 1.5


@dataclass(frozen=True)
class Candidate:
    """One routable engine for one request: ``name`` (its address), the positions of the prompt its
    stored snapshots can give (``reusable``), its ``load`` (generations running and queued) and the
    positions this service's snapshots hold there (``held``: among equally loaded engines a miss goes
    to the emptiest cache, so new prefixes spread over the engines)."""

    name: str
    reusable: int
    load: int
    held: int = 0


class RouteReason(str, Enum):
    """Why the first engine of a route was chosen (a metric label)."""

    CACHE = "cache"  # it reuses the most positions
    MISS = "miss"  # no engine reuses anything: the least loaded
    LOAD_GUARD = "load_guard"  # the best match was overloaded: the least loaded instead
    LOAD = "load"  # the policy ignores reuse: the least loaded
    TURN = "turn"  # round robin

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Route:
    """The engines to try, in order (the first serves), and why the first was chosen."""

    order: tuple[Candidate, ...]
    reason: RouteReason

    @property
    def first(self) -> Candidate:
        return self.order[0]


class RoutingPolicy(Protocol):
    """``route(candidates)``: a :class:`Route` over every candidate (non-empty); thread-safe."""

    name: str

    def route(self, candidates: Sequence[Candidate]) -> Route: ...


def _by_load(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Least loaded first; ties: most reuse, then the emptiest cache, then name (a stable order)."""
    return sorted(candidates, key=lambda c: (c.load, -c.reusable, c.held, c.name))


def _checked(candidates: Sequence[Candidate]) -> Sequence[Candidate]:
    if not candidates:
        raise InvalidArgument("no engine to route to")
    return candidates


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

    def route(self, candidates: Sequence[Candidate]) -> Route:
        by_load = _by_load(_checked(candidates))
        best = min(candidates, key=lambda c: (-c.reusable, c.load, c.name))
        if best.reusable == 0:
            return Route(tuple(by_load), RouteReason.MISS)
        if self.overloaded(best.load, by_load[0].load):
            return Route(tuple(by_load), RouteReason.LOAD_GUARD)
        return Route((best, *(c for c in by_load if c is not best)), RouteReason.CACHE)


class LeastLoaded:
    name = "least_loaded"

    def route(self, candidates: Sequence[Candidate]) -> Route:
        return Route(tuple(_by_load(_checked(candidates))), RouteReason.LOAD)


class RoundRobin:
    """Engines in turn, by name order; the fallbacks are the engines after it."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def route(self, candidates: Sequence[Candidate]) -> Route:
        ordered = sorted(_checked(candidates), key=lambda c: c.name)
        with self._lock:
            start = next(self._turn) % len(ordered)
        return Route(tuple(ordered[start:] + ordered[:start]), RouteReason.TURN)


_POLICIES: dict[str, Callable[..., RoutingPolicy]] = {
    CacheAware.name: CacheAware,
    LeastLoaded.name: LeastLoaded,
    RoundRobin.name: RoundRobin,
}


def routing_names() -> list[str]:
    return list(_POLICIES)


def routing_policy(
    name: str, *, imbalance_abs: int = DEFAULT_IMBALANCE_ABS, imbalance_rel: float = DEFAULT_IMBALANCE_REL
) -> RoutingPolicy:
    """The policy called ``name`` (InvalidArgument naming the choices otherwise); the imbalance
    knobs apply to ``cache_aware``."""
    if name == CacheAware.name:
        return CacheAware(imbalance_abs, imbalance_rel)
    factory = _POLICIES.get(name)
    if factory is None:
        raise InvalidArgument(f"routing: unknown policy {name!r}; one of {', '.join(_POLICIES)}")
    return factory()
