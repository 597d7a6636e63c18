"""Routing policies against hand-worked cases: which engine a request goes to, and in what order the
others are tried."""

from __future__ import annotations

import pytest

from engine_service.api.errors import InvalidArgument
from prefix_service.fleet.routing import CacheAware, Candidate, RouteReason, routing_names, routing_policy


def names(route) -> list[str]:
    return [c.name for c in route.order]


def test_cache_aware_goes_where_the_longest_prefix_is() -> None:
    route = CacheAware().route([Candidate("a", 10, 0), Candidate("b", 40, 2), Candidate("c", 0, 1)])
    assert route.reason is RouteReason.CACHE
    assert names(route) == ["b", "a", "c"]  # the best match, then the rest least loaded first


def test_cache_aware_miss_goes_to_the_least_loaded_then_the_emptiest_cache() -> None:
    route = CacheAware().route(
        [Candidate("a", 0, 3), Candidate("b", 0, 1, held=500), Candidate("c", 0, 1, held=20)]
    )
    assert route.reason is RouteReason.MISS
    assert names(route) == ["c", "b", "a"]


def test_equal_matches_break_ties_by_load() -> None:
    route = CacheAware().route([Candidate("a", 30, 5), Candidate("b", 30, 1)])
    assert names(route)[0] == "b"


@pytest.mark.parametrize(
    ("best_load", "least_load", "guarded"),
    [
        (5, 0, True),  # 5 ahead (> 4) and 5 > 1.5 * 0
        (4, 0, False),  # only 4 ahead
        (12, 7, True),  # 5 ahead and 12 > 10.5
        (30, 21, False),  # 9 ahead, but 30 <= 31.5: the relative condition alone keeps the match
    ],
)
def test_cache_aware_load_guard_needs_both_conditions(best_load, least_load, guarded) -> None:
    route = CacheAware(imbalance_abs=4, imbalance_rel=1.5).route(
        [Candidate("hot", 100, best_load), Candidate("cold", 0, least_load)]
    )
    assert (route.reason is RouteReason.LOAD_GUARD) == guarded
    assert names(route) == (["cold", "hot"] if guarded else ["hot", "cold"])


def test_least_loaded_ignores_reuse_except_for_ties() -> None:
    policy = routing_policy("least_loaded")
    assert names(policy.route([Candidate("a", 100, 2), Candidate("b", 0, 1)])) == ["b", "a"]
    assert names(policy.route([Candidate("a", 100, 1), Candidate("b", 0, 1)])) == ["a", "b"]


def test_round_robin_takes_turns_over_every_engine() -> None:
    policy = routing_policy("round_robin")
    engines = [Candidate("b", 0, 0), Candidate("a", 50, 0), Candidate("c", 0, 0)]
    firsts = [policy.route(engines).first.name for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert sorted(names(policy.route(engines))) == ["a", "b", "c"]  # every engine is a fallback


def test_policies_by_name_and_bad_knobs() -> None:
    assert routing_names() == ["cost", "cache_aware", "least_loaded", "round_robin"]
    with pytest.raises(InvalidArgument, match="routing: unknown policy 'nearest'"):
        routing_policy("nearest")
    with pytest.raises(InvalidArgument, match="imbalance_rel"):
        routing_policy("cache_aware", imbalance_rel=0.5)
    with pytest.raises(InvalidArgument, match="imbalance_abs"):
        CacheAware(imbalance_abs=-1)
    with pytest.raises(InvalidArgument, match="no engine"):
        CacheAware().route([])
