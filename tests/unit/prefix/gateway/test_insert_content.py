"""Inserts are verified against what the engine says a snapshot holds, on every path that stores one.

The fakes record real content (a FakeSession's tokens; the runner's record over the fake executor),
so a snapshot inserted under another prompt's tokens is caught exactly as the engine would catch it.
Each refusal has a stored-and-reused negative control next to it.
"""

from __future__ import annotations

import pytest

from clients.runner_backend import RunnerBackend
from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.content import PREPARED, content_digest
from engine_service.api.errors import NotFound
from engine_service.api.stream_events import Snapshot, SnapshotKind, Started
from engine_service.runtime.runner import Runner
from prefix_service.cache import admission as cache_module
from prefix_service.cache.outcomes import InsertRefusal
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.gateway import insert_flow as insert_flow_module
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.gateway.gateway import Gateway
from tests.unit.prefix.fake_engine import FakeStream, done_event
from tests.unit.runtime.fake_executor import FakeExecutor, FakePrepared

NS = "app"
FRANCE = tuple(ord(c) for c in "What is the capital of France?")
ITALY = tuple(ord(c) for c in "What is the capital of Italy?!")  # same length as FRANCE
assert len(FRANCE) == len(ITALY)


def count_hashes(monkeypatch) -> list[int]:
    """Count content_digest calls made by the gateway and the cache (one list entry per call)."""
    calls: list[int] = []
    for module in (insert_flow_module, cache_module):
        real = module.content_digest
        monkeypatch.setattr(
            module, "content_digest", lambda ids, real=real: calls.append(len(ids)) or real(ids)
        )
    return calls


# -- PrefixCache.insert ---------------------------------------------------------------------------


def test_a_snapshot_holding_other_tokens_is_refused_released_and_never_reused(backend, cache):
    italy = backend.open(ITALY)
    outcome = cache.insert(NS, FRANCE, italy)
    assert outcome.reason == InsertRefusal.CONTENT_MISMATCH and not outcome.stored
    assert italy.closed and len(cache) == 0 and cache.stats().refusals == {"content_mismatch": 1}
    assert cache.lookup(NS, FRANCE + (1,)).match is None
    # control: the snapshot that does hold FRANCE is stored and reused
    assert cache.insert(NS, FRANCE, backend.open(FRANCE)).stored
    match = cache.lookup(NS, FRANCE + (1,)).match
    assert match is not None and match.session.tokens == FRANCE


def test_other_content_under_a_stored_key_is_a_mismatch_not_a_duplicate(backend, cache):
    france = backend.open(FRANCE)
    assert cache.insert(NS, FRANCE, france).stored
    assert cache.insert(NS, FRANCE, backend.open(ITALY)).reason == InsertRefusal.CONTENT_MISMATCH
    assert cache.insert(NS, FRANCE, backend.open(FRANCE)).reason == InsertRefusal.DUPLICATE
    assert [e.snapshot for e in cache.entries()] == [france]


def test_a_prepared_input_in_the_prefix_is_never_stored(backend, cache):
    tokens = (1, 2, 3, 4)
    outcome = cache.insert(NS, tokens, snapshot := backend.open((1, 2, PREPARED, 4)))
    assert outcome.reason == InsertRefusal.PREPARED_INPUT and snapshot.closed
    assert cache.stats().refusals == {"prepared_input": 1}
    assert cache.insert(NS, tokens, backend.open(tokens)).stored  # control


def test_the_tokens_are_hashed_once_and_not_at_all_with_their_digest(backend, cache, monkeypatch):
    calls = count_hashes(monkeypatch)
    assert cache.insert(NS, FRANCE, backend.open(FRANCE)).stored
    assert calls == [len(FRANCE)] and backend.digest_calls == 1
    assert cache.insert(NS, ITALY, backend.open(ITALY), digest=content_digest(ITALY)).stored
    assert calls == [len(FRANCE)] and backend.digest_calls == 2
    for _ in range(3):  # lookups verify nothing: the entries were verified when stored
        assert cache.lookup(NS, FRANCE).match is not None
    assert calls == [len(FRANCE)] and backend.digest_calls == 2


def test_a_snapshot_that_cannot_say_what_it_holds_is_not_stored(backend, cache, monkeypatch):
    def unknown(handle):
        raise NotFound("gone")

    monkeypatch.setattr(backend, "content_digest", unknown)
    outcome = cache.insert(NS, FRANCE, snapshot := backend.open(FRANCE))
    assert outcome.reason == InsertRefusal.INVALID_SNAPSHOT and snapshot.closed


def test_an_entry_evicted_at_once_says_so(backend):
    cache = PrefixCache(backend, max_entries=1, policy="priority")
    assert cache.insert(NS, FRANCE, backend.open(FRANCE), {"priority": "5"}).stored
    low = cache.insert(NS, ITALY, backend.open(ITALY), {"priority": "1"})
    assert low.reason == InsertRefusal.EVICTED and cache.stats().evictions == 1


# -- Gateway.insert (the Insert RPC) and the gateway's captured snapshots ---------------------------


def ask(gateway: Gateway, prompt, owner: str = "bob") -> list:
    return list(gateway.generate(GatewayRequest(NS, prompt, GenConfig(max_new_tokens=3)), CallContext(owner)))


def test_mallory_cannot_store_italy_under_france_and_bob_is_not_served_it(engine, gateway, monkeypatch):
    calls = count_hashes(monkeypatch)
    mallory = engine.open(ITALY)
    live = len(engine.live)
    outcome = gateway.insert(NS, FRANCE, mallory, {}, CallContext("mallory"))
    assert outcome.reason == InsertRefusal.CONTENT_MISMATCH and not outcome.stored
    # the engine's description of her session already differs: refused before any clone or room
    assert engine.take_clone_digests == [] and calls == [len(FRANCE)]
    # while her session generates the engine describes no content: the clone's own check refuses it
    engine.describe_content = False
    outcome = gateway.insert(NS, FRANCE, mallory, {}, CallContext("mallory"))
    assert outcome.reason == InsertRefusal.CONTENT_MISMATCH and not outcome.stored
    assert engine.take_clone_digests == [content_digest(FRANCE)] and calls == [len(FRANCE)] * 2
    engine.describe_content = True
    calls.clear()
    assert len(engine.live) == live and not mallory.closed  # no clone kept; her session is hers
    assert len(gateway.cache) == 0 and gateway.stats().cache.refusals == {"content_mismatch": 2}
    events = ask(gateway, FRANCE)
    assert engine.requests[-1].session == "" and events[-1].reused_positions == 0  # a cold run
    assert [entry.tokens for entry in gateway.cache.entries()] == [FRANCE]  # bob's own verified capture
    # control: a session that does hold FRANCE is stored (one hash for the engine and the cache)
    gateway.clear()
    calls.clear()
    assert gateway.insert(NS, FRANCE, engine.open(FRANCE), {}, CallContext("alice")).stored and calls == [
        len(FRANCE)
    ]
    ask(gateway, FRANCE)
    assert engine.requests[-1].session != "" and engine.requests[-1].tokens == FRANCE[-1:]  # reused


def test_gateway_insert_of_a_session_holding_a_prepared_input_is_refused(engine, gateway):
    session = engine.open((1, 2, PREPARED, 4))
    assert (
        gateway.insert(NS, (1, 2, 3, 4), session, {}, CallContext("alice")).reason
        == InsertRefusal.PREPARED_INPUT
    )
    assert len(gateway.cache) == 0


def test_a_captured_snapshot_whose_engine_content_differs_is_not_stored(engine, gateway, monkeypatch):
    def lying_generate(request):  # the engine captured a session that holds ITALY
        snap = engine.open(ITALY)
        started = Started(engine.open(()), 0, len(request.tokens))
        return FakeStream(
            [
                started,
                Snapshot(snap, len(ITALY), SnapshotKind.PROMPT, content_digest=content_digest(ITALY)),
                done_event(len(request.tokens), 0),
            ]
        )

    monkeypatch.setattr(engine, "generate", lying_generate)
    ask(gateway, FRANCE)
    assert len(gateway.cache) == 0 and gateway.stats().cache.refusals == {"content_mismatch": 1}
    monkeypatch.undo()
    ask(gateway, FRANCE)  # control: the real capture is stored
    assert [entry.tokens for entry in gateway.cache.entries()] == [FRANCE]


# -- the in-process path: PromptCapture.collect over a Runner -------------------------------------


@pytest.fixture
def runner():
    runner = Runner(FakeExecutor(vocab_size=128))
    yield runner
    runner.shutdown(10)


def test_in_process_inserts_are_verified_against_the_runner_record(runner):
    cache = PrefixCache(RunnerBackend(runner), max_entries=4)
    italy = runner.open_session()
    italy.generate_async(list(ITALY), GenConfig(max_new_tokens=1)).wait(10)
    snapshot = italy.clone_async(len(ITALY)).result(10)
    assert cache.insert(NS, FRANCE, snapshot).reason == InsertRefusal.CONTENT_MISMATCH
    runner.flush(10)
    assert not snapshot.valid
    # the CLI path: capture at the prompt boundary, collect after the generation
    france = runner.open_session()
    capture = cache.capture_prompt(france, FRANCE)
    france.generate_async(list(FRANCE), GenConfig(max_new_tokens=3), capture.wrap(None)).wait(10)
    assert capture.collect(NS) == 1 and cache.lookup(NS, FRANCE).match is not None


def test_in_process_capture_after_a_prepared_input_is_refused(runner):
    cache = PrefixCache(RunnerBackend(runner), max_entries=4)
    session = runner.open_session()
    first = session.generate_async([1, 2, 3], GenConfig(max_new_tokens=1)).wait(10)
    prompt = (1, 2, 3, first.tokens[-1], 0, 0)  # what a token key would have to guess
    capture = cache.capture_prompt(session, prompt)
    session.generate_async(FakePrepared((5, 6)), GenConfig(max_new_tokens=2), capture.wrap(None)).wait(10)
    assert capture.collect(NS) == 0 and cache.stats().refusals == {"prepared_input": 1}
