"""The ``cost`` routing policy: a request goes where it is expected to get its first token soonest,
with the option of moving a stored snapshot there first. Spec: docs/ROUTING.md (cost, moves)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_service.api.errors import InvalidArgument
from prefix_service.fleet.rates import CostRates
from prefix_service.fleet.route import Candidate, Move, Route, RouteReason, RouteRequest, checked

DEFAULT_MIN_REUSE_FRACTION = 0.25
DEFAULT_MIN_REUSE_POSITIONS = 0
DEFAULT_ROOM_WEIGHT = 1.0
DEFAULT_MOVE_MIN_LOAD_GAP = 2
# positions one forward prefills at most (the engine CLI's default --prefill_chunk)
EXPORT_WAIT_POSITIONS = 512


@dataclass(frozen=True)
class CostConfig:
    """The policy's knobs (see the module docstring): ``min_reuse_fraction`` in [0, 1],
    ``min_reuse_positions`` >= 0, ``room_weight`` >= 0; ``moves``: consider the move option,
    ``move_min_load_gap`` >= 1: from a holder that many generations busier than the target."""

    min_reuse_fraction: float = DEFAULT_MIN_REUSE_FRACTION
    min_reuse_positions: int = DEFAULT_MIN_REUSE_POSITIONS
    room_weight: float = DEFAULT_ROOM_WEIGHT
    moves: bool = True
    move_min_load_gap: int = DEFAULT_MOVE_MIN_LOAD_GAP

    def __post_init__(self) -> None:
        if not 0 <= self.min_reuse_fraction <= 1:
            raise InvalidArgument(f"min_reuse_fraction must be in [0, 1], got {self.min_reuse_fraction!r}")
        if self.min_reuse_positions < 0:
            raise InvalidArgument(f"min_reuse_positions must be >= 0, got {self.min_reuse_positions!r}")
        if not self.room_weight >= 0:
            raise InvalidArgument(f"room_weight must be >= 0, got {self.room_weight!r}")
        if self.move_min_load_gap < 1:
            raise InvalidArgument(f"move_min_load_gap must be >= 1, got {self.move_min_load_gap!r}")


@dataclass(frozen=True)
class EngineCost:
    """One engine's score for one request: the reuse that counts (its own, or a ``move``'s), the
    positions left to compute and the expected seconds to the first token (``cost_s``). What a log
    line or a test explains."""

    candidate: Candidate
    counts: bool
    reused: int
    compute: int
    cost_s: float
    move: Move | None = None


class CostModel:
    """See the module docstring."""

    name = "cost"

    def __init__(self, config: CostConfig | None = None) -> None:
        self.config = config or CostConfig()

    def costs(self, candidates: Sequence[Candidate], request: RouteRequest) -> list[EngineCost]:
        """Every candidate's score, lowest cost first (the route's order)."""
        checked(candidates)
        c, rates = self.config, request.rates
        prompt = max(request.prompt_positions, max(x.reusable for x in candidates))
        floor = min(x.reusable for x in candidates)
        enough = max(c.min_reuse_positions, c.min_reuse_fraction * prompt)
        holder = _holder((*candidates, *request.sources))
        from_source = holder in request.sources  # a draining engine or the snapshot directory
        movable = holder.movable if c.moves and holder.movable > floor and holder.movable >= enough else 0
        scored = []
        for x in candidates:
            counts = x.reusable > floor and x.reusable >= enough
            reused = x.reusable if counts else floor
            compute = prompt - reused
            fill = min(1.0, max(0.0, x.fill))
            positions = compute * (1 + c.room_weight * fill) + max(0, x.pending)
            cost = rates.prefill_s_per_position * positions + rates.queue_s_per_generation * x.load
            score = EngineCost(x, counts, reused, compute, cost)
            guarded = from_source or holder.load >= x.load + c.move_min_load_gap
            scored.append(self._with_move(score, holder, movable, rates) if guarded else score)
        scored.sort(key=lambda s: (s.cost_s, s.candidate.load, s.candidate.held, s.candidate.name))
        return scored

    def _top_up(
        self, first: Candidate, candidates: Sequence[Candidate], request: RouteRequest
    ) -> Move | None:
        """The chosen engine chosen without a move: another engine's longer reuse moved to it when
        that is cheaper than computing those positions there (a reuse that did not decide still
        saves its prefill, e.g. a header the chosen engine lacks)."""
        others = [x for x in (*candidates, *request.sources) if x.name != first.name]
        if not self.config.moves or not others:
            return None
        holder = _holder(others)
        if _saved_s(holder, holder.movable - first.reusable, request.rates) <= 0:
            return None
        return Move(holder.name, holder.movable)

    @staticmethod
    def _with_move(score: EngineCost, holder: Candidate, movable: int, rates: CostRates) -> EngineCost:
        """``score``, or the move of ``holder``'s ``movable`` positions when that is cheaper."""
        if holder.name == score.candidate.name or movable <= score.reused:
            return score
        saved_s = _saved_s(holder, movable - score.reused, rates)
        if saved_s <= 0:
            return score
        cost = score.cost_s - saved_s
        return EngineCost(
            score.candidate,
            True,
            movable,
            score.compute - (movable - score.reused),
            cost,
            Move(holder.name, movable),
        )

    def route(self, candidates: Sequence[Candidate], request: RouteRequest | None = None) -> Route:
        request = request or RouteRequest()
        scored = self.costs(candidates, request)
        move = scored[0].move or self._top_up(scored[0].candidate, candidates, request)
        if move is not None:
            return Route(tuple(s.candidate for s in scored), RouteReason.MOVE, move)
        if scored[0].counts:
            reason = RouteReason.CACHE
        elif any(s.counts and s.move is None for s in scored):
            reason = RouteReason.LOAD_GUARD
        else:
            reason = RouteReason.MISS
        return Route(tuple(s.candidate for s in scored), reason)


def _holder(pool: Sequence[Candidate]) -> Candidate:
    """The engine a move would copy from: the longest stored reuse, then the least loaded."""
    return max(pool, key=lambda x: (x.movable, -x.load))


def _saved_s(holder: Candidate, gain: int, rates: CostRates) -> float:
    """What moving ``holder``'s reuse saves over computing ``gain`` of its positions (<= 0: the
    move is not worth it; a move is never taken that is slower than recomputing)."""
    if gain <= 0:
        return 0.0
    return rates.prefill_s_per_position * gain - _move_s(holder, rates)


def _move_s(holder: Candidate, rates: CostRates) -> float:
    """The expected seconds of moving ``holder``'s reuse: the measured move, plus the wait for its
    running forward (up to one prefill chunk of its pending positions) unless it pins its snapshots."""
    wait = 0 if holder.pinned_exports else min(max(0, holder.pending), EXPORT_WAIT_POSITIONS)
    return rates.move_s(holder.movable) + rates.prefill_s_per_position * wait
