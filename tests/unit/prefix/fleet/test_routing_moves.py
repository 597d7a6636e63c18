"""The ``cost`` policy's move option against hand-computed cases, the measured move rates, and the
mover's refusals before any engine call (real moves: tests/service/test_routing_moves.py).

Rates here: 1 ms per prefill position, 100 ms per generation ahead, a move 10 ms + 0.1 ms per position.
"""

from __future__ import annotations

import threading
import time

import pytest

from engine_service.api.errors import InvalidArgument
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.fleet.cost_model import CostConfig, CostModel
from prefix_service.fleet.fleet import EngineMember
from prefix_service.fleet.moves import SnapshotMover
from prefix_service.fleet.rates import CostRates, RateMeter
from prefix_service.fleet.route import SNAPSHOT_DIR
from prefix_service.fleet.routing import Candidate, Move, RouteReason, RouteRequest
from prefix_service.gateway.gateway import Gateway
from tests.unit.prefix.fake_engine import FakeEngine

RATES = CostRates(
    prefill_s_per_position=0.001, queue_s_per_generation=0.1, move_overhead_s=0.01, move_s_per_position=0.0001
)


def request(prompt: int, *sources: Candidate, rates: CostRates = RATES) -> RouteRequest:
    return RouteRequest(prompt, rates, tuple(sources))


def test_a_loaded_holder_moves_its_snapshot_to_the_idle_engine() -> None:
    # P = 200, a holds 150 at load 3: a costs 0.001 * 50 + 0.1 * 3 = 0.35 s. b (load 0) computes 200
    # (0.2 s) or moves: 0.2 - 0.001 * 150 + (0.01 + 0.0001 * 150) = 0.075 s -> b, with a's move.
    route = CostModel().route([Candidate("a", 150, 3), Candidate("b", 0, 0)], request(200))
    assert [c.name for c in route.order] == ["b", "a"]
    assert route.reason is RouteReason.MOVE and route.move == Move("a", 150)
    scored = CostModel().costs([Candidate("a", 150, 3), Candidate("b", 0, 0)], request(200))
    assert [round(s.cost_s, 6) for s in scored] == [0.075, 0.35]
    assert (scored[0].reused, scored[0].compute) == (150, 50)


def test_a_move_slower_than_recomputing_is_never_taken() -> None:
    # 2 ms a moved position > 1 ms a computed one: b computes (0.2 s), no move, whatever the load
    slow = CostRates(0.001, 0.1, move_overhead_s=0.0, move_s_per_position=0.002)
    route = CostModel().route([Candidate("a", 150, 3), Candidate("b", 0, 0)], request(200, rates=slow))
    assert route.first.name == "b" and route.move is None and route.reason is RouteReason.LOAD_GUARD
    # the overhead alone can make it slower: 10 ms + 0.1 ms x 100 = 20 ms > 0.001 x (100 - 85) = 15 ms
    route = CostModel().route([Candidate("a", 100, 3), Candidate("b", 85, 0)], request(120))
    assert route.move is None


def test_a_load_gap_of_one_never_moves() -> None:
    # a load read a second ago can count one generation that just ended: a gap of 1 is no reason
    for a_load, moves in ((1, False), (2, True)):
        route = CostModel().route([Candidate("a", 150, a_load), Candidate("b", 0, 0)], request(200))
        assert (route.move is not None) is moves, a_load
    # P = 300, a holds 250 at load 2: a 0.05 + 0.2 = 0.25 s, b 0.3 s computing, 0.3 - 0.25 + 0.035 = 0.085 s
    # moving: at a gap of 3 the move is no option, a serves (and a top-up never moves to the holder)
    engines = [Candidate("a", 250, 2), Candidate("b", 0, 0)]
    assert CostModel().route(engines, request(300)).move == Move("a", 250)
    wide = CostModel(CostConfig(move_min_load_gap=3)).route(engines, request(300))
    assert wide.first.name == "a" and wide.move is None


def test_a_draining_engine_is_a_source_at_any_load() -> None:
    # a (draining, not a candidate) holds 150; b and c hold nothing: the emptier one gets the move
    route = CostModel().route(
        [Candidate("b", 0, 1), Candidate("c", 0, 0)], request(200, Candidate("a", 150, 0))
    )
    assert route.first.name == "c" and route.move == Move("a", 150) and route.reason is RouteReason.MOVE


def test_a_reuse_that_does_not_decide_is_still_topped_up_when_cheaper() -> None:
    # a's 40 (under 25 % of 200) does not decide: b (the emptier) serves. Moving a's 40 to b costs
    # 0.01 + 0.004 = 14 ms and saves 0.001 x (40 - 30) = 10 ms: no move. With a's 60 (still under
    # 25 %): 16 ms < 30 ms saved: the top-up moves it.
    engines = [Candidate("a", 40, 0, fill=0.5), Candidate("b", 30, 0)]
    route = CostModel().route(engines, request(200))
    assert route.first.name == "b" and route.move is None
    route = CostModel().route([Candidate("a", 60, 0, fill=0.5), Candidate("b", 30, 0)], request(280))
    assert route.first.name == "b" and route.move == Move("a", 60) and route.reason is RouteReason.MOVE


def test_no_move_when_off() -> None:
    off = CostModel(CostConfig(moves=False))
    route = off.route([Candidate("a", 150, 3), Candidate("b", 0, 0)], request(200))
    assert route.first.name == "b" and route.move is None and route.reason is RouteReason.LOAD_GUARD


def test_the_holder_itself_never_moves_to_itself() -> None:
    route = CostModel().route([Candidate("a", 150, 0), Candidate("b", 0, 0)], request(200))
    assert route.first.name == "a" and route.move is None and route.reason is RouteReason.CACHE


def test_config_validation_names_the_field() -> None:
    with pytest.raises(InvalidArgument, match="move_min_load_gap"):
        CostConfig(move_min_load_gap=0)
    with pytest.raises(InvalidArgument, match="move_s_per_position"):
        CostRates(move_s_per_position=0.0)
    with pytest.raises(InvalidArgument, match="move_overhead_s"):
        CostRates(move_overhead_s=-1.0)


def test_the_move_rates_are_measured() -> None:
    meter = RateMeter(RATES, alpha=1.0)  # alpha 1: the newest observation is the rate
    meter.observe_move(100, 0.004)  # a short move (< 128 positions): its seconds are the overhead
    assert meter.rates().move_overhead_s == pytest.approx(0.004)
    meter.observe_move(1000, 0.054)  # (0.054 - 0.004) / 1000
    assert meter.rates().move_s_per_position == pytest.approx(0.00005)
    assert meter.moves_observed == 2
    meter.observe_move(1000, 0.0)  # nonsense is ignored
    assert meter.moves_observed == 2
    assert meter.rates().move_s(100) == pytest.approx(0.004 + 0.005)


def member(name: str, engine: FakeEngine, tier=None) -> EngineMember:
    return EngineMember(name, Gateway(PrefixCache(engine, max_entries=8), engine, tier=tier))


def test_the_mover_refuses_without_calling_an_engine_when_it_cannot_pay_off() -> None:
    holder, target = member("a", FakeEngine()), member("b", FakeEngine())
    mover = SnapshotMover(RateMeter(RATES))
    key = tuple(range(1, 101))
    assert mover.move(holder, target, "", key, 0).refusal == "gone"  # nothing stored on the holder
    session = holder.gateway.backend.open(key)
    assert holder.gateway.flow.store("", key, session, {}).stored
    # held: but a reuse of 99 with 95 already there saves 4 ms for a 20 ms move
    assert mover.move(holder, target, "", key, 95).refusal == "slower"
    # worth it, but the fake engines have no snapshot files
    assert mover.move(holder, target, "", key, 0).refusal == "unsupported"
    assert dict(target.move_refusals) == {"gone": 1, "slower": 1, "unsupported": 1}
    assert target.moves_in == holder.moves_out == 0


def test_a_holder_busy_prefilling_makes_the_move_wait_for_its_forward() -> None:
    # an export is taken between two forwards: with 400 positions still to prefill there the move
    # costs 0.025 + 0.001 x 400 = 0.425 s > the 0.15 s it saves: b computes instead
    busy = [Candidate("a", 150, 3, pending=400), Candidate("b", 0, 0)]
    route = CostModel().route(busy, request(200))
    assert route.first.name == "b" and route.move is None
    # negative control: the same holder with nothing left to prefill moves
    assert CostModel().route([Candidate("a", 150, 3), Candidate("b", 0, 0)], request(200)).move == Move(
        "a", 150
    )


def test_a_holder_that_pins_its_snapshots_moves_while_busy_prefilling() -> None:
    # the busy holder above, but its engine exports stored snapshots on an RPC thread: the move costs
    # 0.025 s, not 0.425 s, so b takes it: 0.2 - 0.15 + 0.025 = 0.075 s
    busy = [Candidate("a", 150, 3, pending=400, pinned_exports=True), Candidate("b", 0, 0)]
    route = CostModel().route(busy, request(200))
    assert route.first.name == "b" and route.move == Move("a", 150)
    assert round(CostModel().costs(busy, request(200))[0].cost_s, 6) == 0.075


def test_the_snapshot_directory_is_a_source_without_a_forward_to_wait_for() -> None:
    # the busy holder above (400 positions still to prefill) makes its own move too slow; its file in
    # the snapshot directory moves for 0.025 s < the 0.15 s it saves: b (0.2 - 0.15 + 0.025) with it
    busy = [Candidate("a", 150, 3, pending=400), Candidate("b", 0, 0)]
    folder = request(200, Candidate(SNAPSHOT_DIR, 150, 0))
    route = CostModel().route(busy, folder)
    assert route.first.name == "b" and route.move == Move(SNAPSHOT_DIR, 150)
    assert round(CostModel().costs(busy, folder)[0].cost_s, 6) == 0.075
    # the holder itself idle and the file as long: the engine's own reuse serves (no move to itself),
    # and an idle engine that holds it serves from its own cache, whatever the directory holds
    idle = [Candidate("a", 150, 0), Candidate("b", 0, 0)]
    assert CostModel().route(idle, folder).first.name == "a"
    loaded = [Candidate("a", 150, 2), Candidate("b", 0, 0), Candidate("c", 150, 0)]
    assert CostModel().route(loaded, folder).first.name == "c"
    # a shorter file than the engine's reuse never moves
    route = CostModel().route([Candidate("a", 150, 0)], request(200, Candidate(SNAPSHOT_DIR, 100, 0)))
    assert route.move is None


class BlockingTier:
    """A snapshot directory whose restore takes until ``release`` is set (counts the restores)."""

    def __init__(self) -> None:
        self.release, self.entered, self.calls = threading.Event(), threading.Event(), 0

    def restore(self, cache, namespace, key, done, **engine) -> bool:
        self.calls += 1
        self.entered.set()
        self.release.wait(10)
        done.positions = len(key)
        return True


def test_concurrent_restores_of_one_file_into_one_engine_share_one() -> None:
    tier, mover = BlockingTier(), SnapshotMover(RateMeter(RATES))
    target, other = member("b", FakeEngine(), tier), member("c", FakeEngine(), tier)
    key = tuple(range(1, 101))
    outcomes: dict[str, str] = {}

    def restore(name, into) -> None:
        outcomes[name] = mover.restore(into, "", key, 100).refusal or "moved"

    first = threading.Thread(target=restore, args=("first", target))
    first.start()
    assert tier.entered.wait(10)
    later = threading.Thread(target=restore, args=("later", target))  # waits for the first
    elsewhere = threading.Thread(target=restore, args=("elsewhere", other))  # negative control
    later.start()
    elsewhere.start()
    time.sleep(0.2)
    assert "later" not in outcomes  # still waiting for the first restore
    tier.release.set()
    for thread in (first, later, elsewhere):
        thread.join(10)
    assert outcomes == {"first": "moved", "later": "joined", "elsewhere": "moved"}
    assert tier.calls == 2 and target.moves_in == 1 and dict(target.move_refusals) == {"joined": 1}
