"""EngineSessions.generate over the fake executor: tokens against the fake's own reference, what each
owner holds after the call, the quota that truncates, and refusals that leave nothing behind."""

from __future__ import annotations

import pytest

from engine_service.api.config import GenConfig
from engine_service.api.content import content_digest
from engine_service.api.errors import FailedPrecondition, InvalidArgument, QuotaExceeded, Stopping
from engine_service.api.owners import OwnerQuota
from engine_service.api.stream_events import FinishReason, SnapshotKind
from engine_service.sessions.engine import GenerationRequest
from tests.unit.runtime.fake_executor import reference
from tests.unit.sessions.conftest import PERSISTENT, VOCAB, done, generated, resident, run, snapshots, started

PROMPT = [ord(c) for c in "The quick brown fox"]


def test_a_fresh_session_generates_the_reference_tokens_and_is_released(sessions) -> None:
    events = run(sessions, "alice", PROMPT, max_new_tokens=6)
    assert generated(events) == reference(PROMPT, 0, 6, VOCAB)
    end = done(events)
    assert (end.finish_reason, end.prompt_positions, end.generated_tokens) == (
        FinishReason.LENGTH,
        len(PROMPT),
        6,
    )
    assert sessions.registry.usage("alice").sessions == 0 and resident(sessions) == 0


def test_a_kept_session_weighs_its_position_and_continues_where_it_stopped(sessions) -> None:
    first = run(sessions, "alice", PROMPT, max_new_tokens=3, keep_session=True)
    handle = started(first).session
    position = len(PROMPT) + 3 - 1  # the last token is pending, not committed
    assert done(first).position == position
    assert sessions.registry.usage("alice").positions == position
    more = run(sessions, "alice", [ord("!")], max_new_tokens=2, session=handle, close_session=True)
    history = PROMPT + generated(first) + [ord("!")]
    assert generated(more) == reference(history, 0, 2, VOCAB)
    assert started(more).position == position and started(more).input_positions == 2  # pending + "!"
    assert sessions.registry.usage("alice").sessions == 0  # closed with the call


def test_the_sessions_quota_refuses_before_anything_is_opened(make_sessions) -> None:
    engine = make_sessions(quota=OwnerQuota(max_sessions=1))
    run(engine, "alice", PROMPT, max_new_tokens=1, keep_session=True)
    opened = len(engine.runner._engine._executor.calls_named("open"))
    with pytest.raises(QuotaExceeded):
        run(engine, "alice", PROMPT, max_new_tokens=1)
    assert len(engine.runner._engine._executor.calls_named("open")) == opened
    assert run(engine, "bob", PROMPT, max_new_tokens=1)  # negative control: bob has his own quota


def test_the_positions_quota_ends_a_long_generation_with_length_and_a_reference_prefix(make_sessions) -> None:
    quota = 60
    engine = make_sessions(quota=OwnerQuota(max_positions=quota), growth=16)
    events = run(engine, "alice", PROMPT, max_new_tokens=200)
    got = generated(events)
    assert done(events).finish_reason == FinishReason.LENGTH
    assert len(PROMPT) + len(got) <= quota + 1  # committed positions within the quota (+ the pending token)
    assert len(got) > 16 and got == reference(PROMPT, 0, len(got), VOCAB)
    unlimited = make_sessions(growth=16)  # negative control: the same call without a quota runs to its end
    assert len(generated(run(unlimited, "alice", PROMPT, max_new_tokens=200))) == 200


@pytest.mark.parametrize(
    ("tokens", "request_kw", "message"),
    [
        ([1, VOCAB, 2], {}, r"tokens\[1\] = 128 is outside the vocabulary"),
        ([], {}, "input.tokens is empty"),
        ([5] * 257, {}, "exceeds max_session_tokens=256"),
        (PROMPT, {"config": GenConfig(prefill_breakpoints=(len(PROMPT) + 1,))}, "capture.breakpoints"),
        (PROMPT, {"close_session": True}, "close_session only applies to a given session"),
        (PROMPT, {"snapshot_owner": "bob"}, "capture.snapshot_owner 'bob'"),
    ],
)
def test_bad_requests_are_refused_before_anything_is_held(sessions, tokens, request_kw, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        run(sessions, "alice", tokens, **request_kw)
    assert sessions.registry.usage("alice").sessions == 0 and resident(sessions) == 0


def test_a_session_already_generating_is_refused_and_stays_usable(sessions) -> None:
    handle = started(run(sessions, "alice", PROMPT, max_new_tokens=1, keep_session=True)).session
    call = sessions.generate(
        "alice", GenerationRequest([ord("a")], GenConfig(max_new_tokens=50), session=handle)
    )
    events = call.events(lambda: True)
    next(events)  # started: the generation runs
    with pytest.raises(FailedPrecondition, match="already generating"):
        run(sessions, "alice", [ord("b")], session=handle)
    call.abort()
    assert done(list(events)).finish_reason == FinishReason.CANCELLED
    call.finish()
    assert generated(run(sessions, "alice", [ord("c")], max_new_tokens=1, session=handle))


def test_prompt_and_breakpoint_snapshots_hold_exactly_their_prefix(sessions) -> None:
    config = GenConfig(max_new_tokens=2, prefill_breakpoints=(8,))
    events = run(sessions, "alice", PROMPT, config=config, prompt_snapshot=True)
    taken = {s.kind: s for s in snapshots(events)}
    assert taken[SnapshotKind.BREAKPOINT].position == 8 and taken[SnapshotKind.PROMPT].position == len(PROMPT)
    for snap in taken.values():
        assert snap.content_digest == content_digest(PROMPT[: snap.position])
        assert sessions.describe("alice", snap.handle).position == snap.position
    assert sessions.registry.usage("alice").sessions == 2  # the two snapshots; the fresh session is gone


def test_a_snapshot_handed_to_a_persistent_owner_without_room_is_refused_and_the_answer_goes_on(
    make_sessions,
) -> None:
    engine = make_sessions(quota=OwnerQuota(max_sessions=1))  # alice's fresh session fills her quota
    events = run(engine, "alice", PROMPT, max_new_tokens=3, prompt_snapshot=True, snapshot_owner=PERSISTENT)
    (snap,) = snapshots(events)
    assert snap.handle is None and snap.reason is not None and snap.reason.value == "quota"
    assert generated(events) == reference(PROMPT, 0, 3, VOCAB)
    with pytest.raises(QuotaExceeded):  # for the caller herself the same snapshot fails the call
        run(engine, "alice", PROMPT, max_new_tokens=3, prompt_snapshot=True)


def test_a_draining_engine_refuses_new_generations_but_still_describes(sessions) -> None:
    handle = started(run(sessions, "alice", PROMPT, max_new_tokens=1, keep_session=True)).session
    sessions.drain()
    with pytest.raises(Stopping):
        run(sessions, "alice", PROMPT)
    assert sessions.describe("alice", handle).position == len(PROMPT)


def test_a_one_token_answer_still_takes_its_prompt_snapshot(sessions) -> None:
    (snap,) = snapshots(run(sessions, "alice", PROMPT, max_new_tokens=1, prompt_snapshot=True))
    assert (snap.kind, snap.position) == (SnapshotKind.PROMPT, len(PROMPT)) and snap.handle is not None


def test_a_caller_that_leaves_early_holds_nothing_afterwards(sessions) -> None:
    config = GenConfig(max_new_tokens=100, prefill_breakpoints=(4, 8))
    call = sessions.generate(
        "alice", GenerationRequest(PROMPT, config, prompt_snapshot=True, keep_session=True)
    )
    events = call.events(lambda: True)
    next(events)  # started; snapshots and tokens are queued, never read
    call.finish()
    assert sessions.registry.usage("alice").sessions == 0  # a kept session of a call that did not finish
    assert resident(sessions) == 0
