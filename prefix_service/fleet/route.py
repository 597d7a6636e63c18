"""What a routing policy decides over: one :class:`Candidate` per routable engine and the request's
:class:`RouteRequest` in, a :class:`Route` out (the engines in the order to try them, and why the first).
The policies are ``routing.py`` and ``cost_model.py``; the rates a request carries are ``rates.py``'s."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from engine_service.api.errors import InvalidArgument
from prefix_service.fleet.rates import CostRates


@dataclass(frozen=True)
class Candidate:
    """One routable engine (or move source) for one request."""

    name: str  # its address
    reusable: int  # positions of the prompt its stored snapshots can give
    load: int  # generations running and queued there
    held: int = 0  # positions this service's snapshots hold there
    fill: float = 0.0  # how full this service's share is, in [0, 1] (``Gateway.fill``)
    pending: int = 0  # positions this service's generations there still have to prefill
    # its stored snapshots export without waiting for its running forward (``Info.pinned_exports``;
    # the snapshot directory has no forward either)
    pinned_exports: bool = False
    # of ``reusable``, positions it gives only once a prefill running there stores its snapshot (a
    # request routed there joins it: ``gateway/inflight.py``); discounted by the wait, never movable
    joining: int = 0

    @property
    def movable(self) -> int:
        """Positions of the prompt its stored snapshots hold (what a move can copy)."""
        return self.reusable - self.joining


# The name of the snapshot directory as a move source (never an engine's address, which has a port)
SNAPSHOT_DIR = "<snapshot_dir>"


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know of the request besides the candidates. ``sources``: what serves no new
    request but may give an engine a stored snapshot first (draining engines, the snapshot directory
    as :data:`SNAPSHOT_DIR`)."""

    prompt_positions: int = 0
    rates: CostRates = field(default_factory=CostRates)
    sources: tuple[Candidate, ...] = ()


class RouteReason(str, Enum):
    """Why the first engine of a route was chosen (a metric label)."""

    CACHE = "cache"  # it reuses the most positions
    MISS = "miss"  # no engine reuses anything (that counts): the least loaded / emptiest
    LOAD_GUARD = "load_guard"  # the best match was overloaded (or full): another engine instead
    LOAD = "load"  # the policy ignores reuse: the least loaded
    TURN = "turn"  # round robin
    MOVE = "move"  # another engine's snapshot is moved to it first (cheaper than recomputing there)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Move:
    """Copy the snapshot engine ``source`` holds for the request (reusing ``reusable`` positions of
    it) to the route's first engine before serving there."""

    source: str
    reusable: int


@dataclass(frozen=True)
class Route:
    """The engines to try, in order (the first serves), why the first was chosen, and the ``move``
    to make to the first one before (None: serve from what it holds)."""

    order: tuple[Candidate, ...]
    reason: RouteReason
    move: Move | None = None

    @property
    def first(self) -> Candidate:
        return self.order[0]


class RoutingPolicy(Protocol):
    """``route(candidates, request)``: a :class:`Route` over every candidate (non-empty); thread-safe."""

    name: str

    def route(self, candidates: Sequence[Candidate], request: RouteRequest | None = None) -> Route: ...


def checked(candidates: Sequence[Candidate]) -> Sequence[Candidate]:
    """``candidates``, or InvalidArgument when there are none."""
    if not candidates:
        raise InvalidArgument("no engine to route to")
    return candidates


def by_load(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Least loaded first; ties: most reuse, then the emptiest cache, then name (a stable order)."""
    return sorted(candidates, key=lambda c: (c.load, -c.reusable, c.held, c.name))
