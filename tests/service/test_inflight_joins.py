"""In-flight prefixes joined, on the packaged SmolLM2 behind a real engine server (slow): a request
sharing a long prefix with a generation whose prompt snapshot is not stored yet waits for it, reuses
the prefix and answers what a cold run over the same tokens answers; with joins off (the control) it
computes the prefix itself. The order is fixed by a hook, not by timing: the first generation's
snapshot is stored only once its stream is read, which the test does after the second is waiting."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest

from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.stream_events import Done, Started, Tokens
from engine_service.executors.options import ExecutorSettings
from engine_service.rpc.server import create_server
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED
from prefix_service.engines.connect import connect_engine
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.gateway.inflight import JoinConfig

NEW_TOKENS = 6
rng = random.Random(35)
PREFIX = [rng.randrange(300, 40000) for _ in range(400)]
QUESTION = [rng.randrange(300, 40000) for _ in range(12)]
# a fixed pessimistic rate: the wait's bound is never what ends it under a loaded CPU
JOINS_ON = JoinConfig(max_wait_s=1e4, prefill_s_per_position=1.0)


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[EngineSessions, str]]:
    from engine_service.model.loading.loader import load_model

    loaded = load_model()
    deps = EngineSessions.build(
        loaded,
        loaded.tokenizer,
        model_name="smollm2",
        chat=loaded.chat,
        executor=ExecutorSettings(max_sessions=8, max_session_tokens=1024),
        sessions=UNLIMITED,
    )
    server, port = create_server(deps, "127.0.0.1:0")
    yield deps, f"127.0.0.1:{port}"
    server.stop(0, shutdown_runner=True)


def request(tokens: list[int]) -> GatewayRequest:
    return GatewayRequest("docs", tokens, GenConfig(max_new_tokens=NEW_TOKENS), ignore_eos=True)


def generated(events: list) -> list[int]:
    return [t for e in events if isinstance(e, Tokens) for t in e.ids]


def cold(deps: EngineSessions, tokens: list[int]) -> list[int]:
    with deps.runner.open_session() as session:
        return list(session.generate_async(tokens, GenConfig(max_new_tokens=NEW_TOKENS)).wait(300).tokens)


def second_while_first_unread(address: str, joins: JoinConfig) -> tuple[list, list, object]:
    """The first request started (its stream unread: its snapshot not stored), the second started
    beside it; when joins are on the first is read once the second waits. (first, second, stats)."""
    gateway, channel = connect_engine(address, max_entries=16, ready_timeout=30, joins=joins)
    try:
        call = CallContext("alice")
        first = gateway.generate(request(PREFIX), call)
        result: list = []
        worker = threading.Thread(
            target=lambda: result.append(list(gateway.generate(request(PREFIX + QUESTION), call)))
        )
        worker.start()
        if joins.enabled:
            deadline = time.monotonic() + 300
            while gateway.inflight.stats().waiting != 1:  # an ordering hook, not a timing assert
                assert time.monotonic() < deadline and worker.is_alive(), "the second request never waited"
                time.sleep(0.01)
        else:
            worker.join(300)  # the control: the second runs to its end while the first is unread
            assert result, "the second request did not finish"
        first_events = list(first)
        worker.join(300)
        stats = gateway.stats()
        gateway.clear()
        return first_events, result[0], stats
    finally:
        channel.close()


@pytest.mark.slow
def test_a_request_joins_a_prefix_being_prefilled_and_equals_a_cold_run(engine):
    deps, address = engine
    first, second, stats = second_while_first_unread(address, JOINS_ON)
    assert second[0] == Started("", len(PREFIX), len(QUESTION))  # the shared prefix was cached
    assert second[-1].reused_positions == len(PREFIX) and isinstance(second[-1], Done)
    assert (stats.joins.joins, stats.joins.timeouts) == (1, 0)
    assert generated(second) == cold(deps, PREFIX + QUESTION)
    assert generated(first) == cold(deps, PREFIX)


@pytest.mark.slow
def test_with_joins_off_the_second_request_computes_the_prefix(engine):
    """Control: the same order with --join_wait_ms 0: nothing was stored yet, so it reuses nothing."""
    deps, address = engine
    _, second, stats = second_while_first_unread(address, JoinConfig(max_wait_s=0))
    assert second[0] == Started("", 0, len(PREFIX) + len(QUESTION))
    assert second[-1].reused_positions == 0
    assert (stats.joins.joins, stats.joins.wait_s) == (0, 0.0)
    assert generated(second) == cold(deps, PREFIX + QUESTION)
