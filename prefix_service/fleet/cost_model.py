"""The ``cost`` routing policy: a request goes where it is expected to get its first token soonest.

For a prompt of ``P`` positions and each routable engine ``e`` (``r_e`` positions its cache can reuse,
``L_e`` generations running or queued there, ``W_e`` positions this service's generations there still
have to prefill, ``f_e`` how full this service's share of it is, in [0, 1]):

    floor     = min over engines of r_e          (what every engine holds, e.g. a chat template's header)
    counts_e  = r_e > floor  and  r_e >= max(min_reuse_positions, min_reuse_fraction * P)
    reused_e  = r_e if counts_e else floor       (a reuse too small to matter does not decide)
    compute_e = P - reused_e                     (positions engine e must prefill)
    cost_e    = s_pos * (compute_e * (1 + room_weight * f_e) + W_e)  +  s_queue * L_e

A move (``moves.py``): let ``R`` be the longest reuse that counts held by any engine (routable or a
draining ``source``) or by the snapshot directory (``--snapshot_dir``, a source named
``route.SNAPSHOT_DIR``: its longest stored prefix of the prompt), on ``s`` (ties: the least loaded, an
engine before the directory). For every other engine ``e`` with ``reused_e < R`` -- when ``s`` is a
source (drains, or is the directory) or is over the load guard, ``L_s >= L_e + move_min_load_gap`` (a
load as last read can be one generation that just ended too high, so a gap of one never moves) -- the
move option copies ``s``'s snapshot to ``e`` first:

    move_e    = m_0 + m_pos * R + s_pos * wait_s
    wait_s    = 0 when s pins its stored snapshots (``Info.pinned_exports``: batched-sequence engines
                export them on an RPC thread) or is the directory (its file is read and imported),
                else min(W_s, 512): an export taken between two of s's forwards waits for the running one
                                                 (the measured cost of moving R positions, plus that wait)
    cost_e'   = cost_e - s_pos * (R - reused_e) + move_e

taken when ``move_e < s_pos * (R - reused_e)`` -- a move is never slower than recomputing what it
brings (the room term stays: the positions new to ``e``'s cache are the same either way).
Then, when the engine chosen takes no move (its reuse, or the lack of one, decided), the longest
reuse another engine holds (``r_h > r_first``, counting or not: e.g. a header the chosen engine lacks)
is moved to it when ``move_first < s_pos * (r_h - r_first)`` (``move`` as above): a top-up that only
saves time there. The mover copies only the prefix the request reuses, not the holder's whole entry.
``fleet.py`` checks the entry's exact length once more before moving, and falls back to
recomputing when the move is refused or fails.

``s_pos`` (prefill seconds per position) and ``s_queue`` (what one generation ahead adds to the time to
first token beyond its prefill: its decode steps) are the fleet's measured rates (``rates.RateMeter``).
The queue is the prefill work ahead (an engine shares its forwards among its sessions) plus a cost
per generation there. The room term: the positions a
request computes on ``e`` are stored there, and on a full share each evicts a stored position someone
may come back for, so a fuller cache charges them more: new prefixes spread over the caches with room,
while a hit (few new positions) barely pays it. The lowest cost serves; the others follow in cost order
(ties: less load, fewer positions held, name). Reason: ``move`` when the first engine takes a move,
``cache`` when its own reuse counts, ``load_guard`` when another engine's reuse counts but load or
fullness outweighed it, else ``miss``.
"""

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
        movable = holder.reusable if c.moves and holder.reusable > floor and holder.reusable >= enough else 0
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
        if _saved_s(holder, holder.reusable - first.reusable, request.rates) <= 0:
            return None
        return Move(holder.name, holder.reusable)

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
    """The engine a move would copy from: the longest reuse, then the least loaded."""
    return max(pool, key=lambda x: (x.reusable, -x.load))


def _saved_s(holder: Candidate, gain: int, rates: CostRates) -> float:
    """What moving ``holder``'s reuse saves over computing ``gain`` of its positions (<= 0: the
    move is not worth it; a move is never taken that is slower than recomputing)."""
    if gain <= 0:
        return 0.0
    return rates.prefill_s_per_position * gain - _move_s(holder, rates)


def _move_s(holder: Candidate, rates: CostRates) -> float:
    """The expected seconds of moving ``holder``'s reuse: the measured move, plus -- unless its engine
    pins its stored snapshots (``pinned_exports``: the export is copied on its RPC thread) -- the wait
    for the forward its engine thread is running (such an export is taken between two forwards): up
    to one prefill chunk of what this service's generations there still have to prefill."""
    wait = 0 if holder.pinned_exports else min(max(0, holder.pending), EXPORT_WAIT_POSITIONS)
    return rates.move_s(holder.reusable) + rates.prefill_s_per_position * wait
