"""The ``cost`` routing policy against hand-computed cases (rates: 1 ms per prefill position, 100 ms
per generation ahead), its measured rates, and the issue's four-tenant case over fake engines: a
template header shared by every prompt does not pile tenants on one engine (cache_aware, the negative
control, does)."""

from __future__ import annotations

import pytest

from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidArgument
from engine_service.api.stream_events import Done, Tokens
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.fleet.cost_model import CostConfig, CostModel
from prefix_service.fleet.fleet import EngineMember, Fleet
from prefix_service.fleet.rates import CostRates, RateMeter
from prefix_service.fleet.routing import CacheAware, Candidate, RouteReason, RouteRequest, routing_policy
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.gateway.gateway import Gateway
from tests.unit.prefix.fake_engine import FakeEngine

# moves cost 10 s here, so none is ever taken: these cases are the formula without moves (moves:
# test_routing_moves.py)
RATES = CostRates(prefill_s_per_position=0.001, queue_s_per_generation=0.1, move_overhead_s=10.0)


def request(prompt: int) -> RouteRequest:
    return RouteRequest(prompt, RATES)


def names(route) -> list[str]:
    return [c.name for c in route.order]


def test_a_template_header_does_not_decide() -> None:
    # P = 200: a reuse counts from max(0, 0.25 * 200) = 50 positions; a's 30 (the header) does not,
    # so both compute 200: a 0.001 * 200 * (1 + 0.1) = 0.22 s, b 0.001 * 200 = 0.20 s.
    engines = [Candidate("a", 30, 0, held=230, fill=0.1), Candidate("b", 0, 0)]
    route = CostModel().route(engines, request(200))
    assert names(route) == ["b", "a"] and route.reason is RouteReason.MISS
    # negative control: the old policy lets the header win
    assert names(CacheAware().route(engines)) == ["a", "b"]


def test_what_every_engine_holds_does_not_decide() -> None:
    # both hold the 30-position header (floor 30); at min_reuse_fraction 0 a's 40 > 30 counts,
    # but a reuse equal to the floor everywhere leaves the decision to room: b is emptier.
    policy = CostModel(CostConfig(min_reuse_fraction=0.0))
    assert names(
        policy.route([Candidate("a", 30, 0, fill=0.5), Candidate("b", 30, 0, fill=0.2)], request(200))
    ) == [
        "b",
        "a",
    ]
    # a's 40: 0.001 * 160 * 1.5 = 0.24 s; b: 0.001 * 170 * 1.2 = 0.204 s -> still b (room outweighs 10)
    route = policy.route([Candidate("a", 40, 0, fill=0.5), Candidate("b", 30, 0, fill=0.2)], request(200))
    assert names(route) == ["b", "a"] and route.reason is RouteReason.LOAD_GUARD
    # a's 150: 0.001 * 50 * 1.5 = 0.075 s < b's 0.204 s
    route = policy.route([Candidate("a", 150, 0, fill=0.5), Candidate("b", 30, 0, fill=0.2)], request(200))
    assert names(route) == ["a", "b"] and route.reason is RouteReason.CACHE


@pytest.mark.parametrize(
    ("a_load", "b_load", "first", "reason"),
    [
        (1, 0, "a", RouteReason.CACHE),  # a: 0.001 * 50 + 0.1 = 0.15 s < b: 0.001 * 200 = 0.20 s
        (3, 0, "b", RouteReason.LOAD_GUARD),  # a: 0.05 + 0.3 = 0.35 s > 0.20 s
        (2, 1, "a", RouteReason.CACHE),  # a: 0.05 + 0.2 = 0.25 s < b: 0.20 + 0.1 = 0.30 s
    ],
)
def test_reuse_is_traded_against_the_queue(a_load, b_load, first, reason) -> None:
    route = CostModel().route([Candidate("a", 150, a_load), Candidate("b", 0, b_load)], request(200))
    assert route.first.name == first and route.reason is reason


@pytest.mark.parametrize(("pending", "first"), [(100, "a"), (200, "b")])
def test_prefill_ahead_counts_as_positions(pending, first) -> None:
    # a: 0.001 * (50 + pending) + 0.1; b: 0.001 * 200 + 0.1 = 0.30 s -> a at 100 (0.25 s), b at 200 (0.35 s)
    engines = [Candidate("a", 150, 1, pending=pending), Candidate("b", 0, 1)]
    assert CostModel().route(engines, request(200)).first.name == first


def test_new_prefixes_go_to_caches_with_room_and_hits_barely_pay_it() -> None:
    # a miss: a full a costs 0.001 * 200 * 2 = 0.4 s, b (empty, one generation) 0.2 + 0.1 = 0.3 s
    full_a = [Candidate("a", 0, 0, fill=1.0), Candidate("b", 0, 1, fill=0.0)]
    assert CostModel().route(full_a, request(200)).first.name == "b"
    assert CostModel(CostConfig(room_weight=0.0)).route(full_a, request(200)).first.name == "a"  # 0.2 < 0.3
    # a hit on a full cache: 0.001 * 10 * 2 = 0.02 s, far below recomputing 0.2 s on an empty one
    assert (
        CostModel().route([Candidate("a", 190, 0, fill=1.0), Candidate("b", 0, 0)], request(200)).first.name
        == "a"
    )


def test_ties_keep_a_stable_order_and_costs_explain_the_route() -> None:
    engines = [Candidate("c", 0, 0), Candidate("a", 0, 0), Candidate("b", 0, 0)]
    assert names(CostModel().route(engines, request(100))) == ["a", "b", "c"]
    scored = CostModel().costs([Candidate("a", 150, 1), Candidate("b", 0, 0)], request(200))
    assert [(s.candidate.name, s.counts, s.reused, s.compute) for s in scored] == [
        ("a", True, 150, 50),
        ("b", False, 0, 200),
    ]
    assert [round(s.cost_s, 6) for s in scored] == [0.15, 0.2]


def test_knobs_and_names() -> None:
    assert isinstance(routing_policy("cost"), CostModel)
    assert routing_policy("cost", cost=CostConfig(min_reuse_positions=32)).config.min_reuse_positions == 32
    for bad in ({"min_reuse_fraction": 1.5}, {"min_reuse_positions": -1}, {"room_weight": -0.1}):
        with pytest.raises(InvalidArgument):
            CostConfig(**bad)
    with pytest.raises(InvalidArgument, match="no engine"):
        CostModel().route([], request(10))
    with pytest.raises(InvalidArgument):
        CostRates(prefill_s_per_position=0.0)


def test_rates_follow_what_generations_measured() -> None:
    meter = RateMeter(CostRates(0.0015, 0.25, overhead_s=0.05), alpha=0.2)
    meter.observe(load=0, computed_positions=100, ttft_s=0.25)  # (0.25 - 0.05) / 100: 2 ms per position
    assert meter.rates().prefill_s_per_position == pytest.approx(0.8 * 0.0015 + 0.2 * 0.002)
    meter.observe(load=2, computed_positions=100, ttft_s=0.75)  # (0.75 - 0.05 - 100 * 0.0016) / 2 = 0.27 s
    assert meter.rates().queue_s_per_generation == pytest.approx(0.8 * 0.25 + 0.2 * 0.27)
    meter.observe(load=0, computed_positions=3, ttft_s=0.1)  # too few positions: the overhead
    rates = meter.rates()
    assert rates.overhead_s == pytest.approx(0.8 * 0.05 + 0.2 * 0.1)
    assert rates.prefill_s_per_position == pytest.approx(0.0016) and meter.observed == 3


def test_the_queue_rate_is_measured_net_of_the_prefill_ahead() -> None:
    meter = RateMeter(CostRates(0.001, 0.2, overhead_s=0.0), alpha=1.0)
    meter.observe(load=2, computed_positions=100, ttft_s=0.5, ahead=200)  # (0.5 - 300 * 0.001) / 2
    assert meter.rates().queue_s_per_generation == pytest.approx(0.1)


def test_the_fleet_counts_prefill_ahead_until_the_first_token() -> None:
    engines = {name: FakeEngine() for name in ("a", "b")}
    fleet = Fleet(
        [EngineMember(n, Gateway(PrefixCache(e, max_entries=8), e, "lru")) for n, e in engines.items()],
        routing_policy("cost"),
    )
    stream = fleet.generate(
        GatewayRequest("ns", list(range(1, 41)), GenConfig(max_new_tokens=2)), CallContext("t")
    )
    member = fleet.member(stream.engine)
    assert member.pending == 40 and member.in_flight == 1  # a miss: every position to compute
    events = iter(stream)
    while not isinstance(next(events), Tokens):
        pass
    assert member.pending == 0 and member.in_flight == 1  # prefilled, still decoding
    list(events)
    assert member.in_flight == 0 and fleet.rates.observed == 1


# -- the four-tenant case over fake engines --------------------------------------------------------
HEADER = list(range(10, 40))  # 30 positions every prompt shares (a chat template's header)


def tenant_prompt(tenant: int) -> list[int]:
    system = [100 + 100 * tenant + i for i in range(90)]  # the tenant's own system prompt
    return HEADER + system + [999]


def serve(policy: str) -> tuple[list[str], list[int], list[int]]:
    engines = {name: FakeEngine() for name in ("a", "b")}
    fleet = Fleet(
        [EngineMember(n, Gateway(PrefixCache(e, max_entries=8), e, "lru")) for n, e in engines.items()],
        routing_policy(policy),
    )
    served, reused = [], []
    for tenant in range(4):
        for _ in range(3):  # one request at a time, the same prompt thrice
            prompt = GatewayRequest("ns", tenant_prompt(tenant), GenConfig(max_new_tokens=1))
            events = list(fleet.generate(prompt, CallContext("t")))
            done = events[-1]
            assert isinstance(done, Done)
            served.append(done.engine)
            reused.append(done.reused_positions)
    return served, reused, [len(m.gateway) for m in fleet.members()]


def test_four_tenants_spread_over_both_engines_and_every_repeat_hits() -> None:
    served, reused, entries = serve("cost")
    assert served == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3  # each tenant's first request: the emptier
    # every repeat reuses its whole prompt (all but the last position); tenants 3 and 4 start on the header
    assert reused == [0, 120, 120] * 2 + [30, 120, 120] * 2
    assert entries == [2, 2]


def test_negative_control_cache_aware_piles_every_tenant_on_one_engine() -> None:
    served, _, entries = serve("cache_aware")
    assert set(served) == {"a"} and entries == [4, 0]


def test_the_prefix_service_routes_by_cost_unless_told_otherwise() -> None:
    from prefix_service.__main__ import parse_args

    args = parse_args(["--engine", "127.0.0.1:1"])
    assert (args.routing, args.route_min_reuse_fraction, args.route_min_reuse_positions) == ("cost", 0.25, 0)
    args = parse_args(
        ["--engine", "127.0.0.1:1", "--routing", "cache_aware", "--route_min_reuse_positions", "32"]
    )
    assert (args.routing, args.route_min_reuse_positions) == ("cache_aware", 32)
