"""Generated snapshots through the gateway, against the fake engine: a generation's final snapshot is
stored under the prompt plus the ids it streamed up to its position (boundary "generated", same
namespace), a follow-up reuses it up to its first different id, never content the engine does not
hold; the flag off (and skip_insert) asks for none."""

from __future__ import annotations

from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.stream_events import SnapshotKind, Started
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.cache.retention import BOUNDARY_KEY
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.gateway.gateway import Gateway

NS = "chat"
PROMPT = tuple(range(10, 30))
ANSWER = (500, 501, 502, 503)  # streamed; the engine commits all but the last


def run(gateway: Gateway, prompt=PROMPT, **kwargs) -> list:
    request = GatewayRequest(NS, prompt, GenConfig(max_new_tokens=4), **kwargs)
    return list(gateway.generate(request, CallContext("alice")))


def keys(gateway: Gateway) -> dict[tuple[int, ...], str]:
    return {e.tokens: e.metadata.get(BOUNDARY_KEY, "prompt") for e in gateway.cache.entries(NS)}


def test_the_answer_is_stored_under_the_prompt_and_its_committed_ids(engine, gateway):
    engine.answer = ANSWER
    run(gateway)
    assert engine.requests[0].final_snapshot
    generated = PROMPT + ANSWER[:-1]
    # the prompt's entry is covered by the answer's (a flat engine): dropped, its positions served
    assert keys(gateway) == {generated: str(SnapshotKind.GENERATED)}
    assert gateway.stats().cache.covered == 1
    # the next turn: the answer re-tokenized alike for two ids, then different -- reuse what matches
    follow = PROMPT + ANSWER[:2] + (900, 901)
    first = run(gateway, follow)[0]
    assert isinstance(first, Started) and first.position == len(PROMPT) + 2
    assert engine.requests[1].tokens == follow[len(PROMPT) + 2 :]


def test_the_flag_off_stores_only_the_prompt(engine):
    engine.answer = ANSWER
    gateway = Gateway(PrefixCache(engine, 8), engine, "lru", cache_generated=False)
    run(gateway)
    assert not engine.requests[0].final_snapshot and keys(gateway) == {PROMPT: "prompt"}
    first = run(gateway, PROMPT + ANSWER[:2] + (900,))[0]
    assert first.position == len(PROMPT)  # negative control: only the prompt is reused


def test_skip_insert_asks_for_no_final_snapshot(engine, gateway):
    engine.answer = ANSWER
    run(gateway, store_prompt=False)
    assert not engine.requests[0].final_snapshot and len(gateway.cache) == 0


def test_a_one_token_answer_commits_nothing_past_the_prompt(engine, gateway):
    run(gateway)  # the fake's default answer: one token, pending
    assert keys(gateway) == {PROMPT: "prompt"}


def test_a_snapshot_whose_content_differs_from_the_streamed_ids_is_refused_and_released(engine, gateway):
    engine.answer, engine.committed = ANSWER, (500, 501, 999)  # the session holds other ids
    run(gateway)
    assert keys(gateway) == {PROMPT: "prompt"}
    assert gateway.stats().cache.refusals.get("content_mismatch") == 1
    assert len(engine.live) == 1  # the stored prompt only: the refused clone was closed


def test_a_client_that_leaves_still_stores_the_exact_answer_from_the_drain(engine, gateway):
    engine.answer = ANSWER
    stream = gateway.generate(GatewayRequest(NS, PROMPT, GenConfig(max_new_tokens=4)), CallContext("alice"))
    events = iter(stream)
    next(events)  # started; the tokens and snapshots are read by the drain
    events.close()
    assert PROMPT + ANSWER[:-1] in keys(gateway)


def test_a_regenerated_identical_answer_refreshes_the_entry(engine, gateway):
    engine.answer = ANSWER
    run(gateway)
    live = len(engine.live)
    run(gateway)  # the same answer again: a duplicate, its clone released
    assert len(gateway.cache) == 1 and len(engine.live) == live  # the covered prompt entry dropped


def test_a_full_service_quota_stores_the_answer_after_evicting_for_it(engine):
    # The service's engine quota holds one session, its cache one entry: the answer's room is reserved
    # (evicting the prompt's entry it covers) before its handle is claimed; claimed first, the full
    # quota refuses it (OVER_BUDGET) and only the prompt stays.
    engine.answer, engine.claim_quota = ANSWER, 1
    gateway = Gateway(PrefixCache(engine, 1), engine, "lru")
    run(gateway)
    assert keys(gateway) == {PROMPT + ANSWER[:-1]: str(SnapshotKind.GENERATED)}
    assert "over_budget" not in gateway.stats().cache.refusals and len(engine.live) == 1
