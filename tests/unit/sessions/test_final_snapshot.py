"""The final snapshot (``final_snapshot``) over the fake executor: taken at the last committed token
however a clean generation ends (length, a stop token, cancelled), its content digest that of the
prompt plus the streamed ids up to its position, sent after the last tokens and before Done; none
without the flag, for a one-token answer, or for a caller that left."""

from __future__ import annotations

import pytest

from engine_service.api.config import GenConfig
from engine_service.api.content import content_digest
from engine_service.api.errors import GenerationError
from engine_service.api.owners import OwnerQuota
from engine_service.api.stream_events import Done, FinishReason, Snapshot, SnapshotKind, Tokens
from engine_service.sessions.engine import GenerationRequest
from tests.unit.runtime.fake_executor import reference
from tests.unit.sessions.conftest import PERSISTENT, VOCAB, done, generated, resident, run, snapshots, started

PROMPT = [ord(c) for c in "Once upon a time"]


def final_of(events) -> Snapshot | None:
    found = [s for s in snapshots(events) if s.kind == SnapshotKind.GENERATED]
    assert len(found) <= 1
    return found[0] if found else None


def assert_exact(sessions, owner: str, snap: Snapshot, history: list[int]) -> None:
    """The snapshot holds ``history[:position]``: by the engine's digest and its described position."""
    assert snap.handle is not None and snap.position <= len(history)
    assert snap.content_digest == content_digest(history[: snap.position])
    assert sessions.describe(owner, snap.handle).position == snap.position


def test_a_length_end_snapshots_the_prompt_and_every_generated_token_but_the_pending_one(sessions) -> None:
    events = run(sessions, "alice", PROMPT, max_new_tokens=6, prompt_snapshot=True, final_snapshot=True)
    out = generated(events)
    assert out == reference(PROMPT, 0, 6, VOCAB) and done(events).finish_reason == FinishReason.LENGTH
    snap = final_of(events)
    assert snap is not None and snap.position == len(PROMPT) + 6 - 1 == done(events).position
    assert_exact(sessions, "alice", snap, PROMPT + out)
    assert snap.content_digest != content_digest(PROMPT + out)  # the last token is not committed
    # after the last tokens, before Done
    kinds = [type(e) for e in events]
    at = events.index(snap)
    assert Tokens not in kinds[at + 1 :] and kinds[at + 1 :] == [Done]
    assert sessions.registry.usage("alice").sessions == 2  # the prompt and the final snapshot


def test_a_stop_token_end_snapshots_up_to_the_stop_token(sessions) -> None:
    ref = reference(PROMPT, 0, 8, VOCAB)
    stop = ref[4]
    cut = ref.index(stop)  # its first occurrence ends the answer
    config = GenConfig(max_new_tokens=8, stop_tokens=(stop,))
    events = run(sessions, "alice", PROMPT, config=config, final_snapshot=True)
    assert done(events).finish_reason == FinishReason.STOP and generated(events) == ref[: cut + 1]
    snap = final_of(events)
    if cut == 0:  # nothing committed past the prompt: no snapshot
        assert snap is None
        return
    assert snap is not None and snap.position == len(PROMPT) + cut
    assert_exact(sessions, "alice", snap, PROMPT + ref)


def test_a_continued_session_snapshots_its_whole_history(sessions) -> None:
    first = run(sessions, "alice", PROMPT, max_new_tokens=3, keep_session=True)
    handle = started(first).session
    more = run(sessions, "alice", [ord("!")], max_new_tokens=4, session=handle, final_snapshot=True)
    history = PROMPT + generated(first) + [ord("!")] + generated(more)
    snap = final_of(more)
    assert snap is not None and snap.position == len(history) - 1
    assert_exact(sessions, "alice", snap, history)


def test_a_cancelled_generation_stores_nothing_or_an_exact_snapshot(sessions) -> None:
    config = GenConfig(max_new_tokens=200)
    call = sessions.generate("alice", GenerationRequest(PROMPT, config, final_snapshot=True))
    events = []
    try:
        for event in call.events(lambda: True):
            events.append(event)
            if isinstance(event, Tokens) and len(generated(events)) >= 5:
                call.abort()
    finally:
        call.finish()
    out = generated(events)
    assert done(events).finish_reason == FinishReason.CANCELLED and 5 <= len(out) < 200
    snap = final_of(events)
    assert snap is not None  # the cancel came mid-decode: the committed tokens are snapshotted
    assert snap.position == len(PROMPT) + len(out) - 1
    assert_exact(sessions, "alice", snap, PROMPT + out)


@pytest.mark.parametrize(
    ("max_new_tokens", "flag"),
    [(4, False), (1, True)],  # no flag (negative control); one token: nothing committed past the prompt
)
def test_no_final_snapshot_without_the_flag_or_past_the_prompt(sessions, max_new_tokens, flag) -> None:
    events = run(sessions, "alice", PROMPT, max_new_tokens=max_new_tokens, final_snapshot=flag)
    assert final_of(events) is None and sessions.registry.usage("alice").sessions == 0


def test_no_room_refuses_it_with_quota_and_the_answer_is_whole(make_sessions) -> None:
    engine = make_sessions(quota=OwnerQuota(max_sessions=1))  # alice's fresh session fills her quota
    events = run(engine, "alice", PROMPT, max_new_tokens=4, final_snapshot=True, snapshot_owner=PERSISTENT)
    snap = final_of(events)
    assert snap is not None and snap.handle is None and snap.reason is not None
    assert snap.reason.value == "quota"
    assert generated(events) == reference(PROMPT, 0, 4, VOCAB) and done(events)
    assert engine.registry.usage("alice").sessions == 0


def test_a_caller_that_leaves_before_it_is_sent_holds_nothing(sessions) -> None:
    call = sessions.generate(
        "alice", GenerationRequest(PROMPT, GenConfig(max_new_tokens=3), final_snapshot=True)
    )
    events = call.events(lambda: True)
    next(events)  # started
    sessions.runner.flush(10)  # the generation (and its final clone) runs to its end, never read
    sessions.runner.flush(10)
    assert sessions.registry.usage("alice").sessions == 2  # its session and the final clone's room
    call.finish()
    assert sessions.registry.usage("alice").sessions == 0
    assert resident(sessions) == 0


def test_a_generation_that_fails_midway_takes_no_final_snapshot(sessions, monkeypatch) -> None:
    fake = sessions.runner._engine._executor
    execute = fake.execute

    def failing_after_six(batch):  # the prefill and five decode steps run, then every step fails
        if len(fake.batches) >= 6:
            fake.error_for_sids.update(inp.sid for inp in batch)
        return execute(batch)

    monkeypatch.setattr(fake, "execute", failing_after_six)
    config = GenConfig(max_new_tokens=200)
    call = sessions.generate("alice", GenerationRequest(PROMPT, config, final_snapshot=True))
    events = []
    with pytest.raises(GenerationError, match="fake input failure"):
        try:
            events.extend(call.events(lambda: True))
        finally:
            call.finish()
    assert len(generated(events)) >= 5 and not snapshots(events)
    assert sessions.registry.usage("alice").sessions == 0 and resident(sessions) == 0


@pytest.mark.parametrize("max_new_tokens", [1, 3])
def test_the_first_tokens_never_wait_for_the_prompt_snapshots_clone(
    sessions, monkeypatch, max_new_tokens
) -> None:
    """The prompt snapshot's clone runs on the engine thread after the step that produced the first
    token; the stream yields those tokens first, then the snapshot (exact, at the prompt's end)."""
    import threading
    import time

    from tests.unit.runtime.fake_executor import FakeExecutor

    real_clone, gate = FakeExecutor.clone, threading.Event()

    def slow_clone(self, sid, upto):
        gate.wait(5)  # released once the first token has been streamed
        return real_clone(self, sid, upto)

    monkeypatch.setattr(FakeExecutor, "clone", slow_clone)
    config = GenConfig(max_new_tokens=max_new_tokens)
    call = sessions.generate("alice", GenerationRequest(PROMPT, config, prompt_snapshot=True))
    events, started_at = [], time.monotonic()
    try:
        for event in call.events(lambda: True):
            events.append(event)
            if isinstance(event, Tokens):
                gate.set()
    finally:
        gate.set()
        call.finish()
    assert time.monotonic() - started_at < 4  # the first Tokens came before the gate was opened
    first_tokens = next(i for i, e in enumerate(events) if isinstance(e, Tokens))
    snap = snapshots(events)[0]
    assert first_tokens < events.index(snap) and isinstance(events[-1], Done)
    assert generated(events) == reference(PROMPT, 0, max_new_tokens, VOCAB)
    assert snap.position == len(PROMPT) and snap.content_digest == content_digest(PROMPT)
    assert_exact(sessions, "alice", snap, PROMPT)
