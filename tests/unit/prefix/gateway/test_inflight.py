"""In-flight prefixes joined (``gateway/inflight.py``): the registry's choice, waits, timeouts and
scope isolation, then the gateway over the fake engine: a request sharing the prompt of a generation
still prefilling waits for its snapshot and reuses it; joins off and another scope never wait."""

from __future__ import annotations

import threading
import time

import pytest

from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.errors import Cancelled, InvalidArgument
from engine_service.api.stream_events import Snapshot, SnapshotKind, Started, Tokens
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.gateway.gateway import Gateway
from prefix_service.gateway.inflight import (
    DEFAULT_PREFILL_S_PER_POSITION,
    RATE_ALPHA,
    InflightPrefills,
    JoinConfig,
    Routable,
    shared_positions,
)
from tests.unit.prefix.fake_engine import FakeStream

PREFIX = tuple(range(100, 140))  # 40 tokens
QUESTION = (7, 8, 9)
SLOW = JoinConfig(max_wait_s=1e4, prefill_s_per_position=1.0)  # a wait outlasts any test step


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_until(predicate, what: str) -> None:
    """Poll ``predicate`` (an ordering hook, not a timing assert)."""
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_shared_positions():
    assert shared_positions((1, 2, 3), (1, 2, 4)) == 2
    assert shared_positions((1, 2), (1, 2, 3)) == 2
    assert shared_positions((), (1,)) == 0


@pytest.mark.parametrize(("field", "value"), [("max_wait_s", -1), ("prefill_s_per_position", float("nan"))])
def test_join_config_checks_its_fields(field, value):
    with pytest.raises(InvalidArgument, match=field):
        JoinConfig(**{field: value})


def test_a_join_is_chosen_only_when_cheaper_and_only_in_its_scope():
    clock = Clock()
    registry = InflightPrefills(JoinConfig(max_wait_s=500.0, prefill_s_per_position=1.0), clock=clock)
    prefill = registry.claim("a", list(range(100)))  # 100 positions: expected done at t=100
    # hand-computed: sharing 60 costs 60 s here, plus up to 60 s beside it: 120 > 100 -> join
    join = registry.best("a", [*range(60), -1], 0)
    assert join is not None and (join.prefill, join.shared, join.wait_s) == (prefill, 60, 120.0)
    # sharing 10: 10 + 10 = 20 s here < 100 s to wait -> compute it
    assert registry.best("a", [*range(10), -1], 0) is None
    # what the cache already gives (reused 60) leaves nothing to join for
    assert registry.best("a", [*range(60), -1], 60) is None
    # the same prompt at most len - 1 positions (a lookup clones no further)
    assert registry.best("a", list(range(100)), 0).shared == 99
    # negative control: another scope never sees it, however much it shares
    assert registry.best("b", [*range(60), -1], 0) is None
    assert registry.routable("b", (*range(60), -1)) == Routable(0)
    clock.now = 50.0  # 50 s left: worth 50 positions of the 60 shared; it computes 100
    assert registry.routable("a", (*range(60), -1)) == Routable(10, 10, 100)
    # a wait expected to outlast --join_wait_ms is not started
    capped = InflightPrefills(JoinConfig(max_wait_s=40.0, prefill_s_per_position=1.0), clock=clock)
    capped.claim("a", list(range(100)))  # at t=50: expected done at t=150
    clock.now = 109.0  # 41 s left > 40 s
    assert capped.best("a", [*range(60), -1], 0) is None
    clock.now = 111.0  # 39 s left
    assert capped.best("a", [*range(60), -1], 0).wait_s == 40.0


def test_prefills_of_a_scope_share_the_engine_and_another_scope_changes_nothing():
    clock = Clock()
    registry = InflightPrefills(JoinConfig(max_wait_s=1e4, prefill_s_per_position=1.0), clock=clock)
    prefill = registry.claim("a", list(range(100)))
    assert registry.remaining_s(prefill) == 100.0
    registry.claim("b", [-5] * 50)  # another scope's prefill: not counted
    assert registry.remaining_s(prefill) == 100.0
    registry.claim("a", [-7] * 50)  # two of scope a in flight: each at half speed
    assert registry.remaining_s(prefill) == 200.0


def test_a_waiter_gets_the_snapshot_when_it_comes_then_registers_its_own():
    registry = InflightPrefills(SLOW)
    prefill = registry.claim("a", PREFIX)
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(registry.claim("a", PREFIX + QUESTION)))
    waiter.start()
    wait_until(lambda: registry.stats().waiting == 1, "the waiter never waited")
    registry.end(prefill, snapshot=True)
    waiter.join(30)
    assert result and result[0].tokens == PREFIX + QUESTION  # its own prefill, in flight now
    stats = registry.stats()
    assert (stats.joins, stats.timeouts, stats.failed, stats.in_flight, stats.waiting) == (1, 0, 0, 1, 0)
    assert registry.confirm(result[0], len(PREFIX), captured=False) is None  # no snapshot wanted: ended
    assert registry.stats().in_flight == 0


def test_a_wait_times_out_and_a_failed_prefill_ends_it():
    registry = InflightPrefills(JoinConfig(max_wait_s=0.06, prefill_s_per_position=0.001))
    registry.claim("a", PREFIX)  # about 0.04 s expected: worth a wait of at most 0.06 s
    registry.claim("a", PREFIX + QUESTION, register=False)
    assert (registry.stats().timeouts, registry.stats().joins) == (1, 0)
    registry = InflightPrefills(SLOW)
    prefill = registry.claim("a", PREFIX)
    waiter = threading.Thread(target=lambda: registry.claim("a", PREFIX + QUESTION))
    waiter.start()
    wait_until(lambda: registry.stats().waiting == 1, "the waiter never waited")
    registry.end(prefill)  # the generation ended without its snapshot
    waiter.join(30)
    assert (registry.stats().failed, registry.stats().joins, registry.stats().timeouts) == (1, 0, 0)


@pytest.mark.parametrize(("overrun_to", "joined"), [(81.0, True), (121.0, False)])
def test_a_prefill_that_overruns_its_estimate_is_waited_for_while_it_is_late_by_less_than_the_compute(
    overrun_to, joined
):
    clock = Clock()
    registry = InflightPrefills(JoinConfig(max_wait_s=1e4, prefill_s_per_position=1.0), clock=clock)
    prefill = registry.claim("a", PREFIX)  # 40 positions: expected done at t=40
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(registry.claim("a", PREFIX + QUESTION)))
    waiter.start()  # hand-computed: 40 s to compute here + up to 40 s beside it -> waits until t=80
    wait_until(lambda: registry.stats().waiting == 1, "the waiter never waited")
    clock.now = overrun_to  # the first wait ran out with the prefill 41 s (or 81 s) late
    if joined:  # late by 41 s < the 80 s computing it here would cost: it waits again
        wait_until(lambda: registry.stats().wait_s > 0 and registry.stats().waiting == 1, "no second wait")
        registry.end(prefill, snapshot=True)
    waiter.join(30)
    stats = registry.stats()
    assert (stats.joins, stats.timeouts) == ((1, 0) if joined else (0, 1))  # one outcome per claim
    assert result and result[0].tokens == PREFIX + QUESTION  # then its own prefill in either case


def test_the_call_deadline_bounds_all_waits_together():
    registry = InflightPrefills(SLOW)  # the prefill in flight is worth waiting for ~40 s: it never ends
    registry.claim("a", PREFIX)
    started = time.monotonic()
    own = registry.claim("a", PREFIX + QUESTION, CallContext("x", deadline=started + 0.2))
    assert time.monotonic() - started < 5  # not the 40 s estimate, nor a loop of instant timeouts
    assert own is not None and registry.stats().timeouts == 1


def test_a_waiter_whose_caller_left_is_cancelled():
    registry = InflightPrefills(SLOW)
    registry.claim("a", PREFIX)
    with pytest.raises(Cancelled):
        registry.claim("a", PREFIX + QUESTION, CallContext("x"), lambda: False)
    assert registry.stats().waiting == 0


def test_joins_off_registers_nothing_and_the_rate_is_measured():
    off = InflightPrefills(JoinConfig(max_wait_s=0))
    assert off.claim("a", PREFIX) is None and off.best("a", PREFIX + QUESTION, 0) is None
    clock = Clock()
    registry = InflightPrefills(JoinConfig(), clock=clock)
    assert registry.rate() == DEFAULT_PREFILL_S_PER_POSITION  # until a prefill is measured
    prefill = registry.claim("a", PREFIX)
    clock.now = 0.4  # 40 positions in 0.4 s: 0.01 s each
    registry.end(prefill, snapshot=True)
    assert registry.rate() == pytest.approx(0.01)  # the first measurement replaces the default
    prefill = registry.claim("a", PREFIX)
    clock.now = 0.6  # 40 positions in 0.2 s: 0.005 s each, averaged in
    registry.end(prefill, snapshot=True)
    expected = (1 - RATE_ALPHA) * 0.01 + RATE_ALPHA * 0.005
    assert registry.rate() == pytest.approx(expected)
    short = registry.claim("b", PREFIX[:5])
    clock.now = 10.0
    registry.end(short, snapshot=True)  # too short to be a rate sample
    assert registry.rate() == pytest.approx(expected)


@pytest.mark.parametrize("handle", ["h1", None], ids=["stored", "refused"])
def test_the_tracked_stream_ends_the_prefill_after_its_snapshot_was_handled(handle):
    registry = InflightPrefills(SLOW)
    prefill = registry.claim("a", PREFIX)
    snapshot = Snapshot(handle, len(PREFIX), SnapshotKind.PROMPT)
    stream = registry.track(FakeStream([Started("s", 0, len(PREFIX)), snapshot, Tokens((5,), "x")]), prefill)
    assert next(stream) == Started("s", 0, len(PREFIX)) and not prefill.done
    assert next(stream) == snapshot
    # a handle: ended once its reader asks for more (it stored the snapshot meanwhile); refused: at once
    assert prefill.done == (handle is None)
    next(stream)
    assert prefill.done and prefill.snapshot == (handle is not None)
    assert registry.stats().in_flight == 0


# -- the gateway over the fake engine ------------------------------------------------------------
def request(prompt, namespace: str = "app") -> GatewayRequest:
    return GatewayRequest(namespace, prompt, GenConfig(max_new_tokens=3))


def gateway_with(engine, joins: JoinConfig) -> Gateway:
    return Gateway(PrefixCache(engine, max_entries=8), engine, "lru", joins=joins)


def test_a_request_joins_the_prefill_in_flight_and_reuses_its_snapshot(engine):
    gateway = gateway_with(engine, SLOW)
    call = CallContext("alice")
    first = gateway.generate(request(PREFIX), call)  # started; its snapshot not stored yet
    assert gateway.inflight.stats().in_flight == 1 and len(gateway.cache) == 0
    second: list = []
    waiter = threading.Thread(
        target=lambda: second.append(list(gateway.generate(request(PREFIX + QUESTION), call)))
    )
    waiter.start()
    wait_until(lambda: gateway.inflight.stats().waiting == 1, "the second request never waited")
    list(first)  # the first's snapshot is stored as its stream is read
    waiter.join(30)
    assert second[0][0] == Started("", len(PREFIX), len(QUESTION))
    assert engine.requests[1].tokens == QUESTION  # only the question was computed
    stats = gateway.stats()
    assert (stats.joins.joins, stats.joins.timeouts, stats.cache.hits) == (1, 0, 1)


@pytest.mark.parametrize(
    ("joins", "namespace"),
    [(JoinConfig(max_wait_s=0), "app"), (SLOW, "other")],
    ids=["joins-off", "another-scope"],
)
def test_without_a_join_the_second_request_computes_the_prefix(engine, joins, namespace):
    """Controls: joins off, or the prefill in flight is another scope's: no wait at all (a wait would
    hang here, its first stream unread), and the prefix is computed again."""
    gateway = gateway_with(engine, joins)
    call = CallContext("alice")
    first = gateway.generate(request(PREFIX), call)
    second = list(gateway.generate(request(PREFIX + QUESTION, namespace), call))
    assert second[0] == Started("", 0, len(PREFIX) + len(QUESTION))
    assert engine.requests[1].tokens == PREFIX + QUESTION
    list(first)
    stats = gateway.stats()
    assert (stats.joins.joins, stats.joins.timeouts, stats.joins.wait_s) == (0, 0, 0.0)
