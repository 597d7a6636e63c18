"""Prefix service over real sockets: errors as status codes, a killed service, a restarted engine,
snapshots the engine no longer holds."""

from __future__ import annotations

import pytest

from clients.prefix_client import PrefixClient
from engine_service.api import errors
from engine_service.api.config import GenConfig
from protos import engine_pb2 as epb
from protos import prefix_pb2 as ppb
from tests.service.helpers import PROMPT, gateway_round, in_process_tokens, send_as_is, wait_for


def test_prefix_errors_map_to_codes(engine_factory, prefix_factory) -> None:
    engine = engine_factory()
    prefix = prefix_factory(engine.address, cache_generated=False)
    alice = PrefixClient(prefix.address, owner="alice")
    with pytest.raises(errors.NotFound):
        alice.insert(PROMPT, "not-a-handle")
    with pytest.raises(errors.InvalidArgument):
        alice.insert([], "x")
    with pytest.raises(errors.InvalidArgument):
        alice.generate([65, -3], config=GenConfig(max_new_tokens=1)).collect()
    with pytest.raises(errors.InvalidArgument):
        alice.generate(
            [65] * 300, config=GenConfig(max_new_tokens=1)
        ).collect()  # over max_session_tokens (256)
    with pytest.raises(errors.InvalidArgument):
        zero = epb.GenerationConfig(max_new_tokens=0)
        send_as_is(alice, ppb.GatewayGenerateRequest(tokens=epb.TokenIds(ids=PROMPT), config=zero))
    assert gateway_round(prefix, max_new_tokens=2).done.generated_tokens == 2  # still serving
    assert wait_for(lambda: engine.runner.resident_sessions == 1)  # only the stored snapshot
    engine.stop(grace=0)
    with pytest.raises(errors.Unavailable):
        alice.lookup(PROMPT)


def test_killed_prefix_service_is_cleaned_up_by_its_restart(engine, prefix_factory) -> None:
    base = engine.runner.resident_sessions
    prefix = prefix_factory(engine.address, cache_generated=False)
    for i in range(3):
        gateway_round(prefix, PROMPT[i:], max_new_tokens=2)
    assert wait_for(lambda: engine.runner.resident_sessions == base + 3)
    # a client is mid-stream when the service dies without releasing anything
    stream = PrefixClient(prefix.address, owner="alice").generate(
        PROMPT, config=GenConfig(max_new_tokens=3000), ignore_eos=True
    )
    events = iter(stream)
    next(events)
    prefix.stop(grace=0, release=False)
    with pytest.raises(errors.ForklineError):
        for _ in events:
            pass
    # the 3 snapshots are orphaned in the engine, possibly with the clone the dead stream ran on and
    # that stream's duplicate prompt snapshot (killed before it could release them)
    assert wait_for(lambda: base + 3 <= engine.runner.resident_sessions <= base + 5), (
        engine.runner.resident_sessions
    )
    restarted = prefix_factory(
        engine.address, cache_generated=False
    )  # same owner id: releases what the first one left
    assert wait_for(lambda: engine.runner.resident_sessions == base), engine.runner.resident_sessions
    # ...and caches again
    gateway_round(restarted, max_new_tokens=2)
    assert gateway_round(restarted, max_new_tokens=2).done.reused_positions == len(PROMPT) - 1


def test_engine_restart_is_a_safe_miss_then_caches_again(engine_factory, prefix_factory) -> None:
    engine = engine_factory()
    prefix = prefix_factory(engine.address, cache_generated=False)
    gateway_round(prefix, max_new_tokens=2)
    assert gateway_round(prefix, max_new_tokens=2).done.reused_positions == len(PROMPT) - 1
    old_instance = PrefixClient(prefix.address).stats().engine_instance_id
    engine.stop(grace=0)
    engine = engine_factory(port=engine.port)  # a new engine process on the same address
    alice = PrefixClient(prefix.address, owner="alice")
    miss = alice.lookup(PROMPT)
    assert (miss.session, miss.reason) == (None, "engine_restarted")
    stats = alice.stats()
    assert stats.entries == 0 and stats.dropped_on_restart == 1 and stats.engine_instance_id != old_instance
    first = gateway_round(prefix, max_new_tokens=4)
    second = gateway_round(prefix, max_new_tokens=4)
    assert (first.done.reused_positions, second.done.reused_positions) == (0, len(PROMPT) - 1)
    assert first.tokens == second.tokens == in_process_tokens(PROMPT, 4)


def test_snapshot_the_engine_no_longer_holds_is_dropped_not_kept(engine_factory, prefix_factory) -> None:
    # The engine no longer holds a stored snapshot (someone released the service's handles behind its
    # back). The entry must not linger: a lookup drops it (stats match what the engine holds) and the
    # same prompt can be cached again.
    engine = engine_factory(idle_timeout_s=0.3)
    prefix = prefix_factory(engine.address, cache_generated=False)
    gateway_round(prefix, max_new_tokens=2)
    assert len(prefix.cache) == 1
    for released in engine.deps.registry.release_owner("prefix-service"):
        released.value.close()
    alice = PrefixClient(prefix.address, owner="alice")
    assert alice.lookup(PROMPT).session is None
    assert alice.stats().entries == 0 and prefix.server.deps.backend.sessions.held() == 0
    again = gateway_round(prefix, max_new_tokens=2)  # stores a fresh snapshot
    assert again.done.reused_positions == 0 and alice.stats().entries == 1
    assert gateway_round(prefix, max_new_tokens=2).done.reused_positions == len(PROMPT) - 1
