"""Routing to a prefix in flight (``gateway/inflight.py``, ``fleet/member.py``): over three fake
engines, a request whose prefix an engine is prefilling goes there and joins it when the wait is
worth it; while the wait would cost what computing it does, or in another scope, it goes elsewhere."""

from __future__ import annotations

import threading
import time

import pytest

from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.stream_events import Done
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.fleet.fleet import EngineMember, Fleet
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.gateway.gateway import Gateway
from prefix_service.gateway.inflight import InflightPrefills, JoinConfig
from tests.unit.prefix.fake_engine import FakeEngine

PREFIX = tuple(range(100, 140))  # 40 tokens
QUESTION = (7, 8, 9)
JOINS = JoinConfig(max_wait_s=1e6, prefill_s_per_position=1.0)  # 1 s a position, on the clock below


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fleet(clock) -> Fleet:
    members = []
    for name in ("a", "b", "c"):
        engine = FakeEngine()
        gateway = Gateway(PrefixCache(engine, max_entries=8), engine, "lru")
        gateway.inflight = InflightPrefills(JOINS, gateway.cache.reusable, clock=clock)
        members.append(EngineMember(name, gateway))
    return Fleet(members)


def request(prompt, namespace: str = "ns") -> GatewayRequest:
    return GatewayRequest(namespace, prompt, GenConfig(max_new_tokens=1))


def test_a_request_goes_to_the_engine_prefilling_its_prefix_and_joins(fleet, clock):
    call = CallContext("alice")
    first = fleet.generate(request(PREFIX), call)  # its snapshot is stored as it is read
    clock.now = 35.0  # 5 s of its 40 left: joining is worth 35 positions
    result: list = []
    waiter = threading.Thread(
        target=lambda: result.append(list(fleet.generate(request(PREFIX + QUESTION), call)))
    )
    waiter.start()
    holder = fleet.member(first.engine).gateway.inflight
    deadline = time.monotonic() + 30
    while holder.stats().waiting != 1:  # an ordering hook, not a timing assert
        assert time.monotonic() < deadline and waiter.is_alive(), "the request did not wait there"
        time.sleep(0.005)
    first_events = list(first)
    waiter.join(30)
    done = result[0][-1]
    assert isinstance(done, Done) and isinstance(first_events[-1], Done)
    assert (done.engine, done.reused_positions) == (first.engine, len(PREFIX))
    assert fleet.stats().total.joins.joins == 1


@pytest.mark.parametrize(
    ("now", "namespace"), [(0.0, "ns"), (35.0, "other")], ids=["no-gain", "another-scope"]
)
def test_without_a_worthwhile_join_it_goes_elsewhere_and_computes(fleet, clock, now, namespace):
    """Controls: the wait is worth no position yet (40 s left of 40), or the prefill is another
    scope's: the least loaded engine computes the whole prompt, nobody waits."""
    call = CallContext("alice")
    first = fleet.generate(request(PREFIX), call)
    clock.now = now
    done = list(fleet.generate(request(PREFIX + QUESTION, namespace), call))[-1]
    assert done.engine != first.engine and done.reused_positions == 0
    list(first)
    joins = fleet.stats().total.joins
    assert (joins.joins, joins.timeouts, joins.wait_s) == (0, 0, 0.0)
