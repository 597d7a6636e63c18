"""Session and runner lifetime: close, context manager, garbage collection, shutdown, commands."""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future

import pytest

from engine_service.api.config import GenConfig
from engine_service.api.errors import FailedPrecondition, Unavailable
from engine_service.runtime.commands import BarrierCommand, CloseCommand, CommandTable, OpenCommand
from engine_service.runtime.runner import Runner
from tests.unit.runtime.conftest import VOCAB, collect_and_flush
from tests.unit.runtime.fake_executor import FakeExecutor, reference


def test_close_context_manager_and_garbage_collection_release_sessions(runner, fake):
    s = runner.open_session()
    sid = s._record.sid
    s.close()
    s.close()  # idempotent
    runner.flush()
    assert sid not in fake.seqs and not s.valid
    with pytest.raises(FailedPrecondition):
        s.generate_async([1], GenConfig())
    with runner.open_session() as s2:
        assert s2.valid
    runner.flush()
    assert runner.resident_sessions == 0
    s3 = runner.open_session()
    ref = weakref.ref(s3)
    del s3
    collect_and_flush(runner)
    assert ref() is None and runner.resident_sessions == 0 and fake.seqs == {}


def test_session_dropped_on_the_engine_thread_closes_without_deadlock(runner, fake):
    s = runner.open_session()
    # The open future is dropped inside the callback: the new session dies on the engine thread and
    # its finalizer queues the close from there.
    s.generate_async(
        [1, 2], GenConfig(max_new_tokens=3), lambda u: u.finished and runner.open_session_async()
    ).wait(10)
    collect_and_flush(runner)
    assert len(fake.calls_named("open")) == 2
    assert runner.resident_sessions == 1


def test_generation_keeps_an_unreferenced_session_alive_until_it_ends(runner, fake):
    handle = runner.open_session().generate_async([4, 5, 6], GenConfig(max_new_tokens=4))
    result = handle.wait(10)
    assert result.finish_reason == "length" and result.tokens == tuple(reference([4, 5, 6], 0, 4, VOCAB))
    del handle
    collect_and_flush(runner)
    assert runner.resident_sessions == 0


def test_shutdown_settles_every_future_and_is_idempotent(make_runner):
    fake = FakeExecutor(vocab_size=VOCAB)
    runner = make_runner(fake)
    a, b = runner.open_session(), runner.open_session()
    a.generate_async([1, 2, 3], GenConfig(max_new_tokens=2)).wait(10)
    gate = threading.Event()
    fake.gate, fake.entered = gate, threading.Event()
    updates = []
    running = b.generate_async([4, 5], GenConfig(max_new_tokens=20), updates.append)
    assert fake.entered.wait(10)
    clone = a.clone_async(2)
    opened = runner.open_session_async()
    queued = a.generate_async([6], GenConfig())
    runner.shutdown(timeout=0)
    gate.set()
    runner.shutdown(10)
    runner.shutdown()  # idempotent
    assert not runner.engine_thread.is_alive() and not runner.running
    assert clone.result(1) is None
    with pytest.raises(Unavailable):
        opened.result(1)
    assert running.wait(1).finish_reason == "cancelled" and updates[-1].finish_reason == "cancelled"
    assert queued.wait(1).finish_reason == "cancelled"
    assert fake.seqs == {} and runner.resident_sessions == 0
    assert fake.calls_named("clone") == []
    # After shutdown: nothing is queued, everything answers at once.
    with pytest.raises(Unavailable):
        runner.open_session()
    assert a.clone_async(0).result(0) is None
    with pytest.raises(FailedPrecondition):
        a.generate_async([1], GenConfig())


def test_shutdown_from_a_callback_only_requests_the_stop(runner, fake):
    s = runner.open_session()
    returned = []

    def cb(update):
        runner.shutdown()
        returned.append(True)  # shutdown returned without waiting for the engine thread

    assert s.generate_async([1, 2, 3], GenConfig(prefill_chunk=1), cb).wait(10).finish_reason == "cancelled"
    runner.engine_thread.join(10)
    assert returned and not runner.engine_thread.is_alive() and fake.seqs == {}


def test_open_session_from_a_callback_is_refused_not_deadlocked(runner):
    errors = []

    def cb(update):
        try:
            runner.open_session()
        except FailedPrecondition as exc:
            errors.append(exc)

    runner.open_session().generate_async([1], GenConfig(max_new_tokens=1), cb).wait(10)
    assert len(errors) == 1


def test_startup_failure_is_raised_by_the_constructor():
    class Broken(FakeExecutor):
        def limits(self):
            raise RuntimeError("no limits")

    with pytest.raises(RuntimeError, match="no limits"):
        Runner(Broken())


def test_fingerprint_metrics_and_resident_sessions(runner, fake):
    assert runner.fingerprint == f"fake/v{VOCAB}"
    s = runner.open_session()
    s.generate_async([1, 2, 3, 4], GenConfig(max_new_tokens=3)).wait(10)
    child = s.clone_async(2).result(10)
    m = runner.metrics()
    assert (m.resident_sessions, runner.resident_sessions) == (2, 2)
    assert (m.prefill_positions, m.tokens_decoded, m.clones_succeeded) == (4, 3, 1)
    assert (m.generations_started, m.generations_finished) == (1, 1)
    assert m.forward_batches == len(fake.batches) == 3
    with pytest.raises(AttributeError):
        m.steps = 0  # frozen
    child.close()


def test_command_table_routes_by_type_and_rejects_unknown():
    seen = []
    table = CommandTable({OpenCommand: seen.append, CloseCommand: seen.append})
    open_cmd, close_cmd = OpenCommand(Future()), CloseCommand(3)
    table.dispatch(close_cmd)
    table.dispatch(open_cmd)
    assert seen == [close_cmd, open_cmd]
    assert not table.handles(BarrierCommand())
    with pytest.raises(TypeError, match="unknown command BarrierCommand"):
        table.dispatch(BarrierCommand())

    class Unknown:
        pass

    with pytest.raises(TypeError):
        table.dispatch(Unknown())


def test_runner_rejects_an_unknown_command_without_queueing_it(runner):
    with pytest.raises(TypeError):
        runner._submit(object(), None)
    assert runner.running


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning"
)  # the engine dies on purpose
def test_an_engine_killing_error_still_settles_the_command_or_generation_it_hit(make_runner):
    # SystemExit is not an Exception: the engine thread does not survive it, but the caller it was
    # serving must not wait forever (teardown only settles what is still queued or active).
    fake = FakeExecutor(vocab_size=VOCAB)
    runner = make_runner(fake)
    s = runner.open_session()
    fake.clone_raises = SystemExit("fatal inside clone")
    assert s.clone_async(0).result(5) is None
    runner.engine_thread.join(5)
    assert not runner.running and not fake.seqs  # teardown still closed every session

    runner2 = make_runner(FakeExecutor(vocab_size=VOCAB))
    s2 = runner2.open_session()

    def fatal_at_end(update):
        if update.finished:
            raise SystemExit("fatal in the terminal callback")

    result = s2.generate_async([1, 2, 3], GenConfig(max_new_tokens=2), fatal_at_end).wait(5)
    assert result.finish_reason == "error" and "SystemExit" in result.error
    runner2.engine_thread.join(5)
    assert not runner2.running
