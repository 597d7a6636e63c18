"""The fleet over fake engines: requests go to the engine whose cache holds their prefix (checked
against each engine's own record of what it stored), misses spread, a failing engine passes the
request on before the first event and never after, membership changes drop entries, engines of
another fingerprint are held out."""

from __future__ import annotations

import pytest

from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from engine_service.api.prompts import TextPrompt
from engine_service.api.stream_events import Done, FinishReason, Tokens
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.fleet.fleet import EngineMember, Fleet
from prefix_service.fleet.routing import routing_policy
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.gateway.gateway import Gateway
from prefix_service.gateway.gateway_backend import EngineGenerate
from tests.unit.prefix.fake_engine import FakeEngine

CONFIG = GenConfig(max_new_tokens=1)


class FlakyEngine(FakeEngine):
    """Fails every Generate with ``error`` while it is set (before any event: as an engine that is
    down or full answers)."""

    def __init__(self, fingerprint: str = "fake-model") -> None:
        super().__init__()
        self.fingerprint = fingerprint
        self.error: Exception | None = None

    def generate(self, request: EngineGenerate):
        if self.error is not None:
            raise self.error
        return super().generate(request)


def member(name: str, engine: FakeEngine, serving: list[bool] | None = None) -> EngineMember:
    state = serving if serving is not None else [True]
    return EngineMember(name, Gateway(PrefixCache(engine, max_entries=8), engine, "lru"), lambda: state[0])


def run(fleet: Fleet, prompt, namespace: str = "ns") -> Done:
    events = list(fleet.generate(GatewayRequest(namespace, prompt, CONFIG), CallContext("alice")))
    assert isinstance(events[-1], Done)
    return events[-1]


@pytest.fixture
def engines() -> dict[str, FlakyEngine]:
    return {name: FlakyEngine() for name in ("a", "b", "c")}


@pytest.fixture
def fleet(engines) -> Fleet:
    return Fleet([member(name, engine) for name, engine in engines.items()])


def test_a_prompt_returns_to_the_engine_that_stored_its_prefix(fleet, engines) -> None:
    prompts = [[10 + i, 20, 30, 40, 50] for i in range(3)]
    first = {tuple(p): run(fleet, p).engine for p in prompts}
    assert sorted(first.values()) == ["a", "b", "c"]  # misses spread over the emptiest caches
    for p in prompts:
        longer = p + [60, 70]
        done = run(fleet, longer)
        assert done.engine == first[tuple(p)]
        assert done.reused_positions == len(p)  # the stored prompt snapshot was continued
        # the engine it went to holds the prefix in its own record (the longer prompt's snapshot,
        # which covers it: the prefix's own entry is dropped); the others do not
        holders = [n for n, e in engines.items() if any(s.tokens[: len(p)] == tuple(p) for s in e.live)]
        assert holders == [first[tuple(p)]]


def test_lookup_names_the_engine_holding_the_match(fleet) -> None:
    served = run(fleet, [1, 2, 3, 4]).engine
    found = fleet.lookup("ns", [1, 2, 3, 4, 5], CallContext("alice"))
    assert found.engine == served and found.outcome.reused == 4
    miss = fleet.lookup("other", [1, 2, 3, 4, 5], CallContext("alice"))
    assert miss.outcome.match is None and miss.engine in ("a", "b", "c")


def test_text_is_tokenized_once_and_routed(fleet, engines) -> None:
    done = run(fleet, TextPrompt("hello"))
    assert engines[done.engine].requests[-1].tokens == tuple(ord(c) for c in "hello")
    assert run(fleet, TextPrompt("hello!")).engine == done.engine


@pytest.mark.parametrize("error", [Unavailable("engine down"), ResourceExhausted("engine full")])
def test_a_failing_engine_passes_the_request_on_before_the_first_event(fleet, engines, error) -> None:
    holder = run(fleet, [5, 6, 7, 8]).engine
    engines[holder].error = error
    done = run(fleet, [5, 6, 7, 8, 9])
    assert done.engine != holder and done.reused_positions == 0  # served cold elsewhere, no error
    assert fleet.member(holder).in_flight == 0 and fleet.member(done.engine).in_flight == 0


def test_an_error_that_another_engine_would_share_is_not_retried(fleet, engines) -> None:
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        run(fleet, [1, 2, 10_000])
    assert sum(len(e.requests) for e in engines.values()) == 0


def test_when_every_engine_fails_the_last_error_propagates(fleet, engines) -> None:
    for engine in engines.values():
        engine.error = Unavailable("down")
    with pytest.raises(Unavailable):
        run(fleet, [1, 2, 3])
    assert all(m.in_flight == 0 for m in fleet.members())


def test_no_retry_after_the_first_event(engines) -> None:
    """A stream that breaks after its first event is the client's error: nothing is re-run elsewhere."""
    fleet = Fleet([member("a", engines["a"]), member("b", engines["b"])])
    engines["a"].hang_after = 1  # the stream stops after Started (the gateway reads it before returning)
    engines["b"].hang_after = 1
    stream = fleet.generate(GatewayRequest("ns", [1, 2, 3], CONFIG), CallContext("alice"))
    served = stream.engine
    stream.stop()  # the gateway closes the session: the engine ends the generation cancelled
    events = list(stream)
    assert isinstance(events[-1], Done) and events[-1].finish_reason == FinishReason.CANCELLED
    assert len(engines[served].requests) == 1
    other = "b" if served == "a" else "a"
    assert engines[other].requests == []


def test_down_engines_are_not_routed(engines) -> None:
    up_a, up_b = [True], [True]
    fleet = Fleet([member("a", engines["a"], up_a), member("b", engines["b"], up_b)])
    assert run(fleet, [1, 2, 3]).engine == "a"
    up_a[0] = False
    assert run(fleet, [1, 2, 3, 4]).engine == "b"  # the prefix is on a, but a is down
    up_b[0] = False
    with pytest.raises(Unavailable, match="no engine serves"):
        run(fleet, [1, 2])


def test_an_engine_of_another_fingerprint_is_held_out(engines) -> None:
    odd = FlakyEngine(fingerprint="another-model")
    fleet = Fleet([member("a", engines["a"]), member("odd", odd)])
    for i in range(4):
        assert run(fleet, [i + 1, 2, 3]).engine == "a"
    assert odd.requests == []
    assert [e.routable for e in fleet.stats().engines] == [True, False]


def test_leaving_drops_the_entries_and_releases_them(fleet, engines) -> None:
    holder = run(fleet, [7, 7, 7, 7]).engine
    before = set(engines[holder].live)  # the stored snapshot and the generation's own session
    assert fleet.remove(holder) == 1
    assert len(before - set(engines[holder].live)) == 1  # the snapshot was released in the engine
    done = run(fleet, [7, 7, 7, 7, 8])
    assert done.engine != holder and done.reused_positions == 0
    assert fleet.remove("nobody") == 0


def test_insert_names_its_engine_with_several(fleet, engines) -> None:
    session = engines["b"].open((1, 2, 3))
    with pytest.raises(InvalidArgument, match="engine is required"):
        fleet.insert("ns", [1, 2, 3], session, {}, CallContext("alice"))
    with pytest.raises(NotFound, match="'z'"):
        fleet.insert("ns", [1, 2, 3], session, {}, CallContext("alice"), engine="z")
    assert fleet.insert("ns", [1, 2, 3], session, {}, CallContext("alice"), engine="b").stored
    assert fleet.lookup("ns", [1, 2, 3, 4], CallContext("alice")).engine == "b"


def test_load_guard_sends_a_hit_elsewhere_when_its_engine_is_busy(engines) -> None:
    fleet = Fleet(
        [member("a", engines["a"]), member("b", engines["b"])],
        routing_policy("cache_aware", imbalance_abs=2, imbalance_rel=1.5),
    )
    holder = run(fleet, [3, 3, 3, 3]).engine
    busy = fleet.member(holder)
    for _ in range(3):
        busy.started()  # three generations in flight there
    done = run(fleet, [3, 3, 3, 3, 4])
    assert done.engine != holder
    stats = fleet.stats()
    assert stats.routes["load_guard"] == 1
    assert next(e for e in stats.engines if e.name == holder).load_guarded == 1


def test_stats_sum_over_engines_and_single_engine_is_unchanged(fleet, engines) -> None:
    for i in range(3):
        run(fleet, [i + 1, 9, 9])
    stats = fleet.stats()
    assert stats.total.cache.entries == 3 == sum(e.stats.cache.entries for e in stats.engines)
    single = Fleet([member("only", engines["a"])])
    assert single.stats().total == single.sole().stats()


def test_tokens_events_pass_unchanged(fleet) -> None:
    events = list(fleet.generate(GatewayRequest("ns", [1, 2], CONFIG), CallContext("alice")))
    assert any(isinstance(e, Tokens) and e.ids == (500,) for e in events)


def test_negative_control_round_robin_loses_the_prefix(engines) -> None:
    """The same traffic under round_robin: the continuations land elsewhere and reuse nothing."""
    fleet = Fleet([member("a", engines["a"]), member("b", engines["b"])], routing_policy("round_robin"))
    prompts = [[10 + i, 20, 30, 40, 50] for i in range(3)]
    first = {tuple(p): run(fleet, p).engine for p in prompts}
    later = [run(fleet, p + [60]) for p in prompts]
    assert all(
        done.engine != first[tuple(p)] for p, done in zip(prompts, later, strict=True)
    )  # a b a, then b a b
    assert sum(done.reused_positions for done in later) == 0
