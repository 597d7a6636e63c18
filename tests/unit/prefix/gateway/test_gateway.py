"""The gateway's flows as domain code, against the fake engine (no gRPC): lookup -> Generate with
the prompt captured -> insert, a client leaving mid-stream (stop once, drain what the engine sent),
and the engine-restart state machine."""

from __future__ import annotations

import threading
import time

import pytest

from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.errors import Cancelled, InvalidArgument
from engine_service.api.prompts import TextPrompt
from engine_service.api.stream_events import Started, Tokens
from prefix_service.cache.outcomes import InsertRefusal, MissReason
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.gateway import stream as stream_module
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.gateway.gateway import Gateway
from tests.unit.prefix.fake_engine import FakeEngine, done_event

NS = "app"
PROMPT = tuple(range(10, 30))  # 20 tokens


def request(prompt=PROMPT, **kwargs) -> GatewayRequest:
    return GatewayRequest(NS, prompt, GenConfig(max_new_tokens=3), **kwargs)


def run(gateway: Gateway, prompt=PROMPT, **kwargs) -> list:
    return list(gateway.generate(request(prompt, **kwargs), CallContext("alice")))


def test_generate_stores_the_prompt_then_reuses_it(engine, gateway):
    first = run(gateway)
    assert first == [Started("", 0, len(PROMPT)), Tokens((500,), "x"), done_event(len(PROMPT), 0)]
    assert engine.requests[0].session == "" and engine.requests[0].prompt_snapshot
    assert [entry.tokens for entry in gateway.cache.entries()] == [PROMPT]
    second = run(gateway)
    assert second[0] == Started("", len(PROMPT) - 1, 1)  # the gateway manages the session: blanked
    reused = engine.requests[1]
    assert reused.tokens == PROMPT[-1:] and reused.session.closed  # the matched clone is closed
    # the live session is the caller's (its engine quota): the match is cloned for it and the
    # Generate runs as it; the engine closes the match as the call ends (no Close call after it)
    assert engine.clone_owners[-1] == "alice" and reused.call.owner == "alice"
    assert reused.close_session and engine.closed_as == []
    stats = gateway.stats()
    assert (stats.cache.hits, stats.cache.misses, stats.cache.entries, stats.policy) == (1, 1, 1, "lru")


def test_skip_insert_and_a_disabled_cache_capture_nothing(engine):
    run(Gateway(PrefixCache(engine, 0), engine), store_prompt=True)
    gateway = Gateway(PrefixCache(engine, 8), engine)
    run(gateway, store_prompt=False)
    assert [r.prompt_snapshot for r in engine.requests] == [False, False] and len(gateway.cache) == 0


def test_a_client_that_leaves_stops_the_generation_once_and_the_drain_stores_the_snapshot(engine, gateway):
    stream = gateway.generate(request(), CallContext("alice"))
    events = iter(stream)
    assert isinstance(next(events), Started)
    stream.stop()
    stream.stop()  # gRPC's callback and the generator's own cleanup: one Close
    events.close()
    [(generating, owner)] = engine.closed_as  # the fresh session `started` named, as its caller
    assert generating.tokens == PROMPT and owner == "alice"
    assert len(gateway.cache) == 1  # the snapshot event it never yielded was read and stored
    assert engine.streams[0].cancelled.is_set()


def test_a_stop_after_the_stream_ended_ends_nothing(engine, gateway):
    """gRPC runs the stop callback when the RPC ends, however it ends: after a stream that ended on
    its own it must not close the (already closed) session a second time."""
    run(gateway)
    stream = gateway.generate(request(), CallContext("alice"))
    list(stream)
    closes = len(engine.closed_as)
    stream.stop()
    assert len(engine.closed_as) == closes


def test_a_stream_that_does_not_end_is_cancelled_after_the_drain_timeout(engine, gateway, monkeypatch):
    monkeypatch.setattr(stream_module, "DRAIN_TIMEOUT_S", 0.05)
    engine.hang_after = 1
    engine.close_ends_streams = False  # closing the session does not end this engine stream
    stream = gateway.generate(request(), CallContext("alice"))
    events = iter(stream)
    assert isinstance(next(events), Started)
    stream.stop()
    started = time.monotonic()
    events.close()  # the drain waits DRAIN_TIMEOUT_S, then cancels the call
    assert time.monotonic() - started < 5 and engine.streams[0].cancelled.is_set()
    assert len(gateway.cache) == 0


def test_engine_restart_drops_every_entry_until_something_is_cached_again(engine, gateway):
    run(gateway)
    engine.engine_instance = "instance-2"
    gateway.check_engine()  # the engine pool's refresh or the health watch (no request reads Info)
    lookup = gateway.lookup(NS, PROMPT, CallContext("alice"))
    assert (lookup.outcome.reason, len(gateway.cache), gateway.dropped_on_restart) == (
        MissReason.ENGINE_RESTARTED,
        0,
        1,
    )
    assert gateway.stats().engine_instance_id == "instance-2"
    assert (
        gateway.lookup(NS, PROMPT[:1], CallContext("alice")).outcome.reason == MissReason.TOO_SHORT
    )  # says more
    assert gateway.lookup(NS, (5, 6), CallContext("alice")).outcome.reason == MissReason.ENGINE_RESTARTED
    run(gateway)  # caches again
    assert gateway.lookup(NS, (5, 6), CallContext("alice")).outcome.reason == MissReason.DIVERGED
    assert gateway.lookup(NS, PROMPT, CallContext("alice")).outcome.reused == len(PROMPT) - 1


def test_requests_read_the_engine_info_the_last_check_read(engine, gateway):
    """Info is read by check_engine (the pool, about once a second; the health watch), never per
    request: a lookup, an insert and gateway Generates make no Info call once it was read."""
    run(gateway)  # the first call reads it: nothing was read yet
    assert engine.info_calls == 1
    run(gateway)
    gateway.lookup(NS, PROMPT, CallContext("alice"))
    gateway.insert(NS, PROMPT, engine.open(PROMPT), {}, CallContext("alice"))
    assert engine.info_calls == 1
    engine.vocab_size = 20  # the engine's limits as the next check reads them
    gateway.check_engine()
    assert engine.info_calls == 2
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        gateway.lookup(NS, PROMPT, CallContext("alice"))


def test_a_check_waiting_for_the_engine_does_not_hold_up_another(engine, gateway):
    """The engine pool's check may wait inside its Info call for a down engine (for the health
    watch), and the watch's own check must go on meanwhile: the Info call runs outside the
    gateway's lock (held across it, the two waited for each other until the outage allowance ran out)."""
    release, waiting = threading.Event(), threading.Event()
    answer = engine.info

    def info():
        if not waiting.is_set():  # the pool's check: waits for the engine to serve again
            waiting.set()
            release.wait(60)  # released by the test; the deadline is reached only on failure
        return answer()

    engine.info = info
    pool = threading.Thread(target=gateway.check_engine)
    pool.start()
    assert waiting.wait(60)
    gateway.check_engine()  # the watch's check, as the engine serves again
    assert pool.is_alive()  # it returned while the pool's check is still held: it did not wait for it
    release.set()
    pool.join(60)
    assert not pool.is_alive()


def test_lookup_clones_for_the_caller_and_a_caller_that_left_gets_nothing(engine, gateway):
    run(gateway)
    hit = gateway.lookup(NS, TextPrompt("".join(map(chr, PROMPT))), CallContext("alice"))
    assert hit.tokens == PROMPT and hit.outcome.reused == len(PROMPT) - 1
    assert engine.clone_owners[-1] == "alice" and not hit.outcome.session.closed
    with pytest.raises(Cancelled):
        gateway.lookup(NS, PROMPT, CallContext("alice"), caller_active=lambda: False)
    clone, owner = engine.closed_as[-1]
    assert owner == "alice" and clone.closed and clone.tokens == PROMPT[:-1]


def test_insert_stores_a_clone_and_leaves_the_callers_session(engine, gateway):
    own = engine.open(PROMPT)
    refused = gateway.insert(NS, PROMPT[:-1], own, {}, CallContext("alice"))  # position differs: no clone
    assert refused.reason == InsertRefusal.POSITION_MISMATCH and not refused.stored
    assert engine.clone_calls == []
    assert gateway.insert(NS, PROMPT, own, {"priority": "2"}, CallContext("alice")).stored
    entry = gateway.cache.entries()[0]
    assert entry.snapshot is not own and not own.closed and entry.metadata["priority"] == "2"
    with pytest.raises(InvalidArgument, match="must not be empty"):
        gateway.insert(NS, (), own, {}, CallContext("alice"))


def test_bad_requests_are_refused_before_any_lookup(engine, gateway):
    engine.vocab_size, engine.max_session_tokens = 100, 30
    with pytest.raises(InvalidArgument, match=r"tokens\[1\] = 100 is outside the vocabulary"):
        gateway.lookup(NS, (5, 100), CallContext("alice"))
    with pytest.raises(InvalidArgument, match="max_session_tokens=30"):
        run(gateway, PROMPT + PROMPT)
    with pytest.raises(InvalidArgument, match="input is empty"):
        run(gateway, ())
    assert gateway.cache.stats().misses == 0 and engine.requests == []


def test_the_gateway_needs_the_caches_backend(engine):
    with pytest.raises(InvalidArgument, match="backend"):
        Gateway(PrefixCache(FakeEngine(), 1), engine)


def test_explicit_breakpoints_are_stored_on_an_engine_whose_window_never_evicts(engine, gateway):
    """An API's cache_control positions (``GatewayRequest.breakpoints``): a snapshot at each one past
    the reused prefix, none at the prompt end (the prompt snapshot) or again once stored; none
    without (the control); one outside the prompt is refused before anything runs."""
    assert not engine.info().window.evicts
    run(gateway)
    assert engine.requests[0].config.prefill_breakpoints == ()  # control: no checkpoints here
    gateway.clear()
    run(gateway, breakpoints=(8, 8, len(PROMPT)))
    assert engine.requests[1].config.prefill_breakpoints == (8,)
    assert sorted(len(e.tokens) for e in gateway.cache.entries()) == [8, len(PROMPT)]
    assert PROMPT[:8] in [e.tokens for e in gateway.cache.entries()]
    run(gateway, PROMPT[:12] + (99,), breakpoints=(8, 12))  # 8 is stored; the lookup reuses 12
    assert engine.requests[2].config.prefill_breakpoints == ()
    for bad in ((0,), (len(PROMPT) + 1,)):
        with pytest.raises(InvalidArgument, match="breakpoints"):
            run(gateway, breakpoints=bad)
    assert len(engine.requests) == 3
