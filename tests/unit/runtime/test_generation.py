"""Generation behaviour: ordering, pending token, stops, budget, chunking, breakpoints, batching."""

from __future__ import annotations

import threading
import time

import pytest

from engine_service.api.config import GenConfig
from engine_service.api.errors import FailedPrecondition
from tests.unit.runtime.conftest import VOCAB, Recorder, engine_paused
from tests.unit.runtime.fake_executor import FakeExecutor, FakePrepared, reference

PROMPT = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]


def sid_of(session) -> int:
    return session._record.sid


def test_tokens_match_reference_and_position_excludes_pending(runner, fake):
    s = runner.open_session()
    rec = Recorder(runner)
    result = s.generate_async(PROMPT, GenConfig(max_new_tokens=5, seed=9), rec).wait(10)
    assert result.finish_reason == "length"
    assert result.tokens == tuple(reference(PROMPT, 9, 5, VOCAB))
    assert rec.tokens == list(result.tokens)
    assert s.position == len(PROMPT) + 4 and s.has_pending
    assert rec.updates[-1].finished and sum(u.finished for u in rec.updates) == 1
    assert rec.wrong_thread == 0
    assert [c[3] for c in fake.calls_named("set_sampling")] == [9]
    m = result.metrics
    assert (m.prompt_positions, m.generated_tokens) == (len(PROMPT), 5)
    assert m.time_to_first_token_s is not None and m.total_s >= m.time_to_first_token_s


def test_pending_token_is_fed_first_when_continuing(runner, fake):
    s = runner.open_session()
    first = s.generate_async(PROMPT, GenConfig(max_new_tokens=3)).wait(10)
    second = s.generate_async([5, 6], GenConfig(max_new_tokens=3, seed=4)).wait(10)
    history = PROMPT + list(first.tokens) + [5, 6]
    assert second.tokens == tuple(reference(history, 4, 3, VOCAB))
    assert second.metrics.prompt_positions == 2  # the replayed pending token is not input
    assert s.position == len(history) + 2
    # Negative control: dropping the pending token would give different tokens.
    assert second.tokens != tuple(reference(PROMPT + list(first.tokens[:-1]) + [5, 6], 4, 3, VOCAB))


def test_stop_token_beats_budget_and_is_kept_by_the_session(runner):
    expected = reference(PROMPT, 0, 3, VOCAB)
    stop = expected[2]
    assert stop not in expected[:2]  # otherwise the test would stop earlier
    s = runner.open_session()
    result = s.generate_async(PROMPT, GenConfig(max_new_tokens=3, stop_tokens=(stop,))).wait(10)
    assert result.finish_reason == "stop" and result.tokens == tuple(expected)
    assert s.position == len(PROMPT) + 2 and s.has_pending
    cont = s.generate_async([1], GenConfig(max_new_tokens=2)).wait(10)
    assert cont.tokens == tuple(reference(PROMPT + expected + [1], 0, 2, VOCAB))


@pytest.mark.parametrize("budget,stop_at", [(1, None), (3, None), (4, 0), (4, 1)])
def test_speculative_outputs_are_cut_by_budget_and_stops(make_runner, budget, stop_at):
    fake = FakeExecutor(vocab_size=VOCAB, speculative=True)
    runner = make_runner(fake)
    s = runner.open_session()
    expected = reference(PROMPT, 0, budget, VOCAB)
    stops = () if stop_at is None else (expected[stop_at],)
    if stop_at is not None:
        assert expected[stop_at] not in expected[:stop_at]
        expected = expected[: stop_at + 1]
    result = s.generate_async(PROMPT, GenConfig(max_new_tokens=budget, stop_tokens=stops)).wait(10)
    assert result.tokens == tuple(expected)
    assert result.finish_reason == ("length" if stop_at is None else "stop")
    assert s.position == len(PROMPT) + len(expected) - 1
    # The executor committed past the cut; the next start rewinds it to the accepted position.
    cont = s.generate_async([3], GenConfig(max_new_tokens=3)).wait(10)
    assert cont.tokens == tuple(reference(PROMPT + expected + [3], 0, 3, VOCAB))


def test_prefill_chunks_respect_config_and_preferred_batch_tokens(make_runner):
    fake = FakeExecutor(vocab_size=VOCAB, preferred_batch_tokens=4)
    runner = make_runner(fake)
    s = runner.open_session()
    rec = Recorder(runner)
    result = s.generate_async(PROMPT, GenConfig(max_new_tokens=2, prefill_chunk=3), rec).wait(10)
    sizes = [b[0].size() for b in fake.batches[:4]]
    assert sizes == [3, 3, 3, 1]
    assert [u.position for u in rec.updates[:4]] == [3, 6, 9, 10]
    assert result.tokens == tuple(reference(PROMPT, 0, 2, VOCAB))
    s2 = runner.open_session()
    fake.batches.clear()
    s2.generate_async(PROMPT, GenConfig(max_new_tokens=1, prefill_chunk=512)).wait(10)
    assert [b[0].size() for b in fake.batches] == [4, 4, 2]


def test_breakpoints_emit_updates_at_exact_positions_and_allow_clones(runner, fake):
    s = runner.open_session()
    clones = {}

    def observe(update):
        if update.breakpoint is not None:
            clones[update.breakpoint] = s.clone_async(update.breakpoint)

    rec = Recorder(runner, observe)
    cfg = GenConfig(max_new_tokens=2, prefill_chunk=4, prefill_breakpoints=(50, 6, 3, 10))
    result = s.generate_async(PROMPT, cfg, rec).wait(10)
    bps = [(u.breakpoint, u.position, u.tokens) for u in rec.updates if u.breakpoint is not None]
    assert bps == [(3, 3, ()), (6, 6, ()), (10, 10, (result.tokens[0],))]
    assert [u.position for u in rec.updates] == [3, 6, 10, 11]
    for bp, future in clones.items():
        child = future.result(10)
        assert child is not None and child.position == bp
        out = child.generate_async([77], GenConfig(max_new_tokens=2)).wait(10)
        assert out.tokens == tuple(reference(PROMPT[:bp] + [77], 0, 2, VOCAB))
    # Breakpoints are absolute session positions: a continuation from 11 (+1 pending) stops at 14.
    rec2 = Recorder(runner)
    s.generate_async([1, 2, 3, 4], GenConfig(max_new_tokens=1, prefill_breakpoints=(5, 14)), rec2).wait(10)
    assert [u.breakpoint for u in rec2.updates if u.breakpoint] == [14]
    assert [u.position for u in rec2.updates] == [12, 14, 16]  # pending token alone, then the input


def test_prepared_input_is_chunked_as_views_and_counts_positions(runner, fake):
    s = runner.open_session()
    first = s.generate_async([4, 5], GenConfig(max_new_tokens=2)).wait(10)
    prepared = FakePrepared([7, 8, 9, 10, 11])
    result = s.generate_async(prepared, GenConfig(max_new_tokens=3, prefill_chunk=2)).wait(10)
    history = [4, 5] + list(first.tokens) + list(prepared.history_values())
    assert result.tokens == tuple(reference(history, 0, 3, VOCAB))
    assert result.metrics.prompt_positions == 5
    chunks = [b[0] for b in fake.batches if b[0].prepared is not None]
    assert [c.prepared.values for c in chunks] == [(7, 8), (9, 10), (11,)]
    # Decode feedback after a prepared prefill is raw tokens.
    assert all(b[0].tokens is not None for b in fake.batches[-2:])


def test_decode_steps_of_several_sessions_share_one_forward(make_runner):
    fake = FakeExecutor(vocab_size=VOCAB)
    runner = make_runner(fake, max_decode_sequences=2)
    sessions = [runner.open_session() for _ in range(3)]
    with engine_paused(runner, fake):
        handles = [
            s.generate_async([i + 1], GenConfig(max_new_tokens=6, seed=i)) for i, s in enumerate(sessions)
        ]
    for i, h in enumerate(handles):
        assert h.wait(10).tokens == tuple(reference([i + 1], i, 6, VOCAB))
    # batches[0]: the pause's blocker; [1]: the three 1-token prompts; then decode steps only.
    assert len(fake.batches[1]) == 3
    decode_sizes = [len(b) for b in fake.batches[2:]]
    assert max(decode_sizes) == 2  # packed, and never more than max_decode_sequences
    m = runner.metrics()
    assert m.forward_batches == len(fake.batches) and m.tokens_decoded == 1 + 18


def test_second_concurrent_generation_fails_with_failed_precondition(runner, fake):
    s = runner.open_session()
    gate = threading.Event()
    fake.gate, fake.entered = gate, threading.Event()
    handle = s.generate_async(PROMPT, GenConfig(max_new_tokens=2))
    assert fake.entered.wait(10)
    with pytest.raises(FailedPrecondition):
        s.generate_async([1], GenConfig())
    fake.gate = None
    gate.set()
    assert handle.wait(10).tokens == tuple(reference(PROMPT, 0, 2, VOCAB))


def test_terminal_callback_may_start_the_next_generation(runner):
    s = runner.open_session()
    handles = []
    rec = Recorder(
        runner,
        lambda u: (
            u.finished and not handles and handles.append(s.generate_async([9], GenConfig(max_new_tokens=2)))
        ),
    )
    first = s.generate_async(PROMPT, GenConfig(max_new_tokens=2), rec).wait(10)
    second = handles[0].wait(10)
    assert second.tokens == tuple(reference(PROMPT + list(first.tokens) + [9], 0, 2, VOCAB))


def test_cancel_and_close_end_generations_as_cancelled(runner):
    s = runner.open_session()
    rec = Recorder(runner, lambda u: len(u.tokens) and handle.cancel())
    handle = s.generate_async(PROMPT, GenConfig(max_new_tokens=50), rec)
    result = handle.wait(10)
    assert result.finish_reason == "cancelled" and len(result.tokens) == 1
    assert rec.updates[-1].finished and rec.updates[-1].finish_reason == "cancelled"
    handle.cancel()  # a no-op once done
    s2 = runner.open_session()
    h2 = s2.generate_async(PROMPT, GenConfig(max_new_tokens=50), lambda u: u.tokens and s2.close())
    assert h2.wait(10).finish_reason == "cancelled"
    runner.flush()
    assert runner.resident_sessions == 1


def test_idle_engine_does_not_spin(runner):
    s = runner.open_session()
    s.generate_async([1, 2], GenConfig(max_new_tokens=2)).wait(10)
    runner.flush()
    before = runner.metrics().steps
    time.sleep(0.05)
    # After the barrier the loop makes at most one more pass before blocking on the inbox; a busy
    # loop would make thousands in 50 ms.
    assert runner.metrics().steps - before <= 1


def test_session_token_limit_ends_generation_with_length(make_runner):
    fake = FakeExecutor(vocab_size=VOCAB, max_session_tokens=12)
    runner = make_runner(fake)
    s = runner.open_session()
    result = s.generate_async(PROMPT, GenConfig(max_new_tokens=10)).wait(10)
    # Prompt 10 -> positions 10, 11, 12 with a pending token each; 12 leaves no room for the pending one.
    assert result.finish_reason == "length" and result.tokens == tuple(reference(PROMPT, 0, 3, VOCAB))
    assert s.position == 12
    follow = s.generate_async([1], GenConfig())
    assert follow.wait(10).finish_reason == "error" and "max_session_tokens" in str(follow.error)


def test_wait_from_a_callback_refuses_instead_of_deadlocking(runner):
    s = runner.open_session()
    errors = []

    def cb(update):
        try:
            handle.wait(1)
        except FailedPrecondition as exc:
            errors.append(exc)

    handle = s.generate_async([1, 2], GenConfig(max_new_tokens=1), cb)
    assert handle.wait(10).finish_reason == "length"
    assert errors, "wait() on the engine thread must raise"


def test_breakpoint_at_prompt_end_survives_accepted_speculative_drafts(make_runner):
    # The output that ends prefill also commits an accepted draft, moving the position past the
    # breakpoint; the observer must still be told about the breakpoint, and a clone there must hold
    # exactly the prompt.
    fake = FakeExecutor(vocab_size=VOCAB, speculative=True)
    runner = make_runner(fake)
    s = runner.open_session()
    clones = {}

    def observe(update):
        if update.breakpoint is not None:
            clones[update.breakpoint] = s.clone_async(update.breakpoint)

    rec = Recorder(runner, observe)
    cfg = GenConfig(max_new_tokens=4, prefill_chunk=4, prefill_breakpoints=(4, len(PROMPT)))
    result = s.generate_async(PROMPT, cfg, rec).wait(10)
    assert result.tokens == tuple(reference(PROMPT, 0, 4, VOCAB))
    assert sorted(clones) == [4, len(PROMPT)]
    bp_update = next(u for u in rec.updates if u.breakpoint == len(PROMPT))
    assert bp_update.position == len(PROMPT)
    for bp, future in clones.items():
        child = future.result(10)
        assert child is not None and child.position == bp
        out = child.generate_async([77], GenConfig(max_new_tokens=2)).wait(10)
        assert out.tokens == tuple(reference(PROMPT[:bp] + [77], 0, 2, VOCAB))


def test_prefill_is_not_starved_when_decoders_fill_the_preferred_batch(make_runner):
    # preferred_batch_tokens (2) <= decoding sequences (3): the decoders alone use up the budget, yet a
    # new prompt must still get a prefill chunk in every batch, not wait until the decoders finish.
    fake = FakeExecutor(vocab_size=VOCAB, preferred_batch_tokens=2)
    runner = make_runner(fake, max_decode_sequences=8)
    decoders = [runner.open_session() for _ in range(3)]
    first_tokens = [threading.Event() for _ in decoders]
    handles = [
        s.generate_async(
            [5 + i], GenConfig(max_new_tokens=200), lambda u, ev=ev: ev.set() if u.tokens else None
        )
        for i, (s, ev) in enumerate(zip(decoders, first_tokens, strict=True))
    ]
    for ev in first_tokens:
        assert ev.wait(10)
    late = runner.open_session().generate_async(PROMPT, GenConfig(max_new_tokens=1)).wait(10)
    assert late.finish_reason == "length"
    assert not any(h.done() for h in handles), "the late prompt ran only after the decoders finished"
    for h in handles:
        h.cancel()
