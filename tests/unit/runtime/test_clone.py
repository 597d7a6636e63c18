"""Clone semantics (SEED_TESTS.md "Runner and cloning"), against the fake executor's hash model."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import Future

import pytest

from engine_service.api.answers import close_child_when_done
from engine_service.api.config import GenConfig
from engine_service.api.errors import ResourceExhausted
from tests.unit.runtime.conftest import VOCAB, Recorder, collect_and_flush, engine_paused
from tests.unit.runtime.fake_executor import FakeExecutor, reference

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]


def generate(session, prompt, **cfg):
    return session.generate_async(prompt, GenConfig(**cfg)).wait(10)


def generated_source(runner):
    """A session that generated on PROMPT, and the resident session count with it."""
    s = runner.open_session()
    generate(s, PROMPT, max_new_tokens=2)
    return s, runner.resident_sessions


def sid_of(session) -> int:
    return session._record.sid


def test_closed_or_failed_session_refuses_clone_at_once(runner, fake):
    s = runner.open_session()
    generate(s, PROMPT, max_new_tokens=2)
    s.close()
    future = s.clone_async(3)
    assert future.done() and future.result() is None
    # A failed (poisoned) source: refused at once too, with no executor call.
    bad = runner.open_session()
    fake.error_for_sids.add(sid_of(bad))
    assert generate(bad, PROMPT, max_new_tokens=2).finish_reason == "error"
    assert not bad.valid
    future = bad.clone_async(0)
    assert future.done() and future.result() is None
    runner.flush()
    assert fake.calls_named("clone") == []


def test_executor_without_clone_support_refuses_and_source_stays_usable(make_runner):
    fake = FakeExecutor(vocab_size=VOCAB, clones=False)
    runner = make_runner(fake)
    s = runner.open_session()
    first = generate(s, PROMPT, max_new_tokens=3)
    assert s.clone_async(5).result(10) is None
    assert len(fake.calls_named("clone")) == 1  # the executor was asked and refused
    assert s.valid
    more = generate(s, [5, 6], max_new_tokens=4)
    assert more.tokens == tuple(reference(PROMPT + list(first.tokens) + [5, 6], 0, 4, VOCAB))


def test_clone_copies_committed_prefix_starts_idle_and_runs_its_own_suffix(runner, fake):
    s = runner.open_session()
    first = generate(s, PROMPT, max_new_tokens=4, seed=3)
    assert s.position == len(PROMPT) + 3  # the 4th token is pending, not committed
    child = s.clone_async(5).result(10)
    assert child is not None and child.position == 5
    assert not child.generating and not child.has_pending
    assert fake.seqs[sid_of(child)].seed is None  # no inherited sampler
    out = generate(child, [40, 41], max_new_tokens=5, seed=7)
    assert out.tokens == tuple(reference(PROMPT[:5] + [40, 41], 7, 5, VOCAB))
    # The source is unaffected: it continues from its own history, pending token first.
    cont = generate(s, [42], max_new_tokens=3, seed=3)
    assert cont.tokens == tuple(reference(PROMPT + list(first.tokens) + [42], 3, 3, VOCAB))
    # Negative control: the child's suffix really depends on the prefix it was cloned with.
    assert out.tokens != tuple(reference(PROMPT[:6] + [40, 41], 7, 5, VOCAB))


def test_upto_zero_clone_of_clone_and_grandchild_outlives_ancestors(runner, fake):
    s = runner.open_session()
    generate(s, PROMPT, max_new_tokens=2)
    empty = s.clone_async(0).result(10)
    assert empty is not None and empty.position == 0
    assert ("clone", sid_of(s), 0) in fake.calls_named("clone")
    child = s.clone_async(7).result(10)
    grandchild = child.clone_async(4).result(10)
    assert grandchild is not None and grandchild.position == 4
    s.close()
    child.close()
    runner.flush()
    assert grandchild.valid
    out = generate(grandchild, [3], max_new_tokens=4, seed=1)
    assert out.tokens == tuple(reference(PROMPT[:4] + [3], 1, 4, VOCAB))
    out = generate(empty, [8, 9], max_new_tokens=2)
    assert out.tokens == tuple(reference([8, 9], 0, 2, VOCAB))


@pytest.mark.parametrize("upto", [-1, "pending", 10**9])
def test_out_of_range_upto_is_refused_without_executor_call(runner, fake, upto):
    s = runner.open_session()
    generate(s, PROMPT, max_new_tokens=3)
    if upto == "pending":
        upto = s.position + 1  # the pending token is not committed
    assert s.clone_async(upto).result(10) is None
    assert fake.calls_named("clone") == []
    assert s.clone_async(s.position).result(10) is not None  # control: the boundary itself works


def test_clone_from_first_callback_runs_before_next_forward(runner, fake):
    s = runner.open_session()
    futures = []
    marks = []

    def on_update(update):
        if not futures:
            marks.append(len(fake.calls_named("execute")))
            futures.append(s.clone_async(update.position))

    rec = Recorder(runner, on_update)
    result = s.generate_async(PROMPT, GenConfig(max_new_tokens=3, prefill_chunk=3), rec).wait(10)
    assert rec.wrong_thread == 0
    assert rec.updates[0].position == 3 and rec.updates[0].tokens == ()
    child = futures[0].result(10)
    assert child is not None and child.position == 3
    # The clone call sits between the first and the second forward.
    names = [c[0] for c in fake.calls if c[0] in ("execute", "clone")]
    assert names[:3] == ["execute", "clone", "execute"]
    assert marks == [1]
    assert s.position == 11 and len(result.tokens) == 3
    assert result.tokens == tuple(reference(PROMPT, 0, 3, VOCAB))
    out = generate(child, [50], max_new_tokens=2)
    assert out.tokens == tuple(reference(PROMPT[:3] + [50], 0, 2, VOCAB))


def test_clone_from_terminal_callback_survives_dropping_the_source(runner, fake):
    holder = [runner.open_session()]
    futures = []
    rec = Recorder(runner, lambda u: u.finished and futures.append(holder[0].clone_async(u.position)))
    handle = holder[0].generate_async(PROMPT, GenConfig(max_new_tokens=3), rec)
    result = handle.wait(10)
    del holder[:], handle, rec
    collect_and_flush(runner)
    child = futures[0].result(10)
    assert child is not None and child.valid and child.position == len(PROMPT) + 2
    assert runner.resident_sessions == 1  # the source was closed, the clone lives
    out = generate(child, [60], max_new_tokens=3)
    assert out.tokens == tuple(reference(PROMPT + list(result.tokens[:2]) + [60], 0, 3, VOCAB))


def test_speculative_rows_past_the_accepted_position_cannot_be_cloned(make_runner):
    fake = FakeExecutor(vocab_size=VOCAB, speculative=True)
    runner = make_runner(fake)
    s = runner.open_session()
    prompt = [1, 2, 3, 4, 5]
    result = generate(s, prompt, max_new_tokens=2)
    assert result.tokens == tuple(reference(prompt, 0, 2, VOCAB))
    assert s.position == 6 and fake.seqs[sid_of(s)].written == 7  # accepted 6 while 7 were written
    assert s.clone_async(7).result(10) is None
    assert all(call[2] != 7 for call in fake.calls_named("clone"))  # refused by the runner
    for upto in (4, 6):
        child = s.clone_async(upto).result(10)
        assert child is not None and child.position == upto
    # Negative control: the executor alone would have cloned the speculative row.
    bare = FakeExecutor(vocab_size=VOCAB, speculative=True)
    from engine_service.executors.base import ExecInput
    from engine_service.executors.sampling import SamplingParams

    sid = bare.open_session()
    bare.set_sampling(sid, SamplingParams.of(GenConfig()), 0)
    bare.execute([ExecInput(sid, 0, tokens=tuple(prompt))])
    assert bare.clone(sid, 7) is not None


def test_refusal_and_capacity_pressure_leave_source_usable(make_runner):
    fake = FakeExecutor(vocab_size=VOCAB, max_sessions=2)
    runner = make_runner(fake)
    s = runner.open_session()
    first = generate(s, PROMPT, max_new_tokens=2)
    fake.refuse_clone = True
    assert s.clone_async(3).result(10) is None
    fake.refuse_clone = False
    child = s.clone_async(3).result(10)
    assert child is not None
    assert s.clone_async(3).result(10) is None  # capacity: 2 sessions resident
    with pytest.raises(ResourceExhausted):
        runner.open_session()
    assert s.valid
    cont = generate(s, [7], max_new_tokens=3)
    assert cont.tokens == tuple(reference(PROMPT + list(first.tokens) + [7], 0, 3, VOCAB))
    assert runner.metrics().clones_refused == 2


def test_clone_exception_is_a_refusal_and_engine_keeps_running(runner, fake):
    s = runner.open_session()
    first = generate(s, PROMPT, max_new_tokens=2)
    fake.clone_raises = RuntimeError("boom")
    assert s.clone_async(4).result(10) is None
    fake.clone_raises = None
    assert runner.running and s.valid
    child = s.clone_async(4).result(10)
    assert child is not None
    cont = generate(s, [7], max_new_tokens=2)
    assert cont.tokens == tuple(reference(PROMPT + list(first.tokens) + [7], 0, 2, VOCAB))


def test_poisoned_source_is_not_cloned_even_when_queued_before_failure(runner, fake):
    s = runner.open_session()
    fake.error_for_sids.add(sid_of(s))
    gate = threading.Event()
    fake.gate, fake.entered = gate, threading.Event()
    handle = s.generate_async(PROMPT, GenConfig())
    assert fake.entered.wait(10)
    queued = s.clone_async(0)  # the session is still healthy when this is queued
    assert not queued.done()
    gate.set()
    assert handle.wait(10).finish_reason == "error"
    assert queued.result(10) is None
    # Queued from the terminal callback of a failing generation: refused too.
    s2 = runner.open_session()
    fake.error_for_sids.add(sid_of(s2))
    futures = []
    rec = Recorder(runner, lambda u: u.finished and futures.append(s2.clone_async(0)))
    assert s2.generate_async(PROMPT, GenConfig(), rec).wait(10).finish_reason == "error"
    assert futures[0].result(10) is None
    assert fake.calls_named("clone") == []


def test_cancelled_prefill_exposes_only_the_consumed_prefix(runner, fake):
    s = runner.open_session()
    prompt = list(range(1, 9))
    rec = Recorder(runner, lambda u: u.position == 4 and handle.cancel())
    handle = s.generate_async(prompt, GenConfig(prefill_chunk=4), rec)
    result = handle.wait(10)
    assert result.finish_reason == "cancelled" and result.tokens == ()
    assert result.metrics.prompt_positions == 4
    assert s.position == 4
    assert s.clone_async(8).result(10) is None
    child = s.clone_async(4).result(10)
    assert child is not None
    out = generate(child, [9], max_new_tokens=2)
    assert out.tokens == tuple(reference(prompt[:4] + [9], 0, 2, VOCAB))


@pytest.mark.parametrize("how", ["close", "cancel", "drop"])
def test_clone_completes_when_source_is_closed_cancelled_or_dropped_right_after(runner, fake, how):
    s = runner.open_session()
    futures = []

    def on_update(update):
        if update.position >= 5 and not futures:
            futures.append(s.clone_async(5))
            if how == "cancel":
                handle.cancel()
            elif how == "close":
                s.close()

    handle = s.generate_async(PROMPT, GenConfig(max_new_tokens=50, prefill_chunk=5), on_update)
    result = handle.wait(10)
    if how == "drop":
        assert result.finish_reason == "length"
        del s, handle
        collect_and_flush(runner)
        assert runner.resident_sessions == 1  # the dropped source is closed, its clone lives
    else:
        assert result.finish_reason == "cancelled"
    child = futures[0].result(10)
    assert child is not None and child.position == 5
    out = generate(child, [70], max_new_tokens=2)
    assert out.tokens == tuple(reference(PROMPT[:5] + [70], 0, 2, VOCAB))


def test_shutdown_yields_none_for_queued_clones_and_closes_every_session(make_runner):
    fake = FakeExecutor(vocab_size=VOCAB)
    runner = make_runner(fake)
    s = runner.open_session()
    generate(s, PROMPT, max_new_tokens=2)
    other = runner.open_session()
    gate = threading.Event()
    fake.gate, fake.entered = gate, threading.Event()
    handle = other.generate_async([1, 2], GenConfig(max_new_tokens=5))
    assert fake.entered.wait(10)
    future = s.clone_async(3)
    runner.shutdown(timeout=0)  # requests the stop; the engine is still inside execute
    gate.set()
    runner.shutdown(10)
    assert future.result(10) is None
    assert handle.wait(10).finish_reason == "cancelled"
    assert fake.calls_named("clone") == []
    assert fake.seqs == {} and runner.resident_sessions == 0
    assert not s.valid and s.clone_async(1).result(1) is None


def test_shutdown_from_callback_settles_queued_clone_without_executor(runner, fake):
    s = runner.open_session()
    futures = []

    def on_update(update):
        if not futures:
            futures.append(s.clone_async(update.position))
            runner.shutdown()  # from the engine thread: only requests the stop

    handle = s.generate_async(PROMPT, GenConfig(prefill_chunk=3), on_update)
    assert handle.wait(10).finish_reason == "cancelled"
    assert futures[0].result(10) is None
    runner.engine_thread.join(10)
    assert not runner.engine_thread.is_alive()
    assert fake.calls_named("clone") == []
    assert fake.seqs == {}


def test_abandoned_clone_future_releases_its_session(runner, fake):
    s, baseline = generated_source(runner)
    # Before completion: dropped or cancelled while queued -> the clone never happens.
    with engine_paused(runner, fake):
        dropped = s.clone_async(3)
        del dropped
        gc.collect()
        cancelled = s.clone_async(4)
        assert cancelled.cancel()
    collect_and_flush(runner)
    assert fake.calls_named("clone") == []
    assert runner.resident_sessions == baseline
    # After completion: the child nobody owns is closed when the future is collected.
    future = s.clone_async(5)
    child_sid = sid_of(future.result(10))
    assert runner.resident_sessions == baseline + 1
    del future
    collect_and_flush(runner)
    assert runner.resident_sessions == baseline
    assert ("close", child_sid) in fake.calls_named("close")


def test_close_child_when_done_closes_only_a_child_nobody_will_receive(runner, fake):
    s, baseline = generated_source(runner)
    # Given up on while queued: the child is closed once the clone completes.
    with engine_paused(runner, fake):
        pending = s.clone_async(3)
        close_child_when_done(pending)
    child = pending.result(10)
    runner.flush(10)
    assert child is not None and not child.valid and runner.resident_sessions == baseline
    # Already complete: closed at once, through the caller's own close when given.
    done = s.clone_async(4)
    done.result(10)
    closed = []
    close_child_when_done(done, lambda c: closed.append(c) or c.close())
    runner.flush(10)
    assert closed == [done.result()] and runner.resident_sessions == baseline
    # A refusal, a failure or a cancellation has nothing to close.
    for settle in (
        lambda f: f.set_result(None),
        lambda f: f.set_exception(ResourceExhausted("no")),
        lambda f: f.cancel(),
    ):
        future = Future()
        close_child_when_done(future, closed.append)
        settle(future)
    assert len(closed) == 1
