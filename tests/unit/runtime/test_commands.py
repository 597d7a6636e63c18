"""How each command settles its caller when the engine does not run it to the end.

``fail``: its handler raised and the engine carries on. ``abandon``: the engine thread dies of a
BaseException while handling it. ``settle_unrun``: still queued when the engine stopped.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future

import pytest

from engine_service.api.answers import CloneRefusal
from engine_service.api.config import GenConfig
from engine_service.api.errors import ResourceExhausted, Unavailable
from engine_service.runtime.clone import CloneFuture
from engine_service.runtime.commands import (
    BarrierCommand,
    CancelCommand,
    CloneCommand,
    CloseCommand,
    EngineHooks,
    OpenCommand,
    StartCommand,
)
from engine_service.runtime.state import ActiveGeneration
from tests.unit.runtime.conftest import VOCAB
from tests.unit.runtime.fake_executor import FakeExecutor


class Engine:
    """Records what a command asks of the engine loop."""

    def __init__(self) -> None:
        self.finished: list[tuple[object, str, str | None]] = []
        self.ran: list[object] = []
        self.counts = {"clones_refused": 0}
        self.hooks = EngineHooks(self.finish, self.ran.append, self.counts)

    def finish(self, gen, reason, error=None) -> None:
        self.finished.append((gen, reason, None if error is None else f"{type(error).__name__}: {error}"))


def generation() -> ActiveGeneration:
    return ActiveGeneration(handle=None, config=GenConfig(), callback=None, input=(1,))


def outcome(future: Future) -> object:
    if not future.done():
        return "pending"
    exc = future.exception()
    return future.result() if exc is None else f"{type(exc).__name__}: {exc}"


BOOM = ValueError("boom")
FATAL = SystemExit("fatal")


def settle(command, how: str, engine: Engine) -> None:
    if how == "fail":
        command.fail(BOOM, engine.hooks)
    elif how == "abandon":
        command.abandon(FATAL, engine.hooks)
    else:
        command.settle_unrun(engine.hooks)


@pytest.mark.parametrize(
    ("make", "how", "expected"),
    [
        (lambda f: OpenCommand(f), "fail", "ValueError: boom"),
        (
            lambda f: OpenCommand(f),
            "abandon",
            "Stopping: engine thread stopped: SystemExit",
        ),  # an Unavailable
        (lambda f: OpenCommand(f), "unrun", "Stopping: runner is stopping"),
        (lambda f: BarrierCommand(f), "fail", "ValueError: boom"),
        (lambda f: BarrierCommand(f), "abandon", None),
        (lambda f: BarrierCommand(f), "unrun", None),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_command_with_a_future_settles_it(make, how, expected):
    future: Future = Future()
    engine = Engine()
    command = make(future)
    settle(command, how, engine)
    assert outcome(future) == expected
    assert engine.finished == engine.ran == [] and engine.counts["clones_refused"] == 0


@pytest.mark.parametrize(
    ("how", "expected", "refused"),
    [("fail", "ValueError: boom", 0), ("abandon", None, 0), ("unrun", None, 1)],
)
def test_a_clone_settles_its_future_while_the_caller_holds_it(how, expected, refused):
    future = CloneFuture()
    engine = Engine()
    settle(CloneCommand(3, 2, weakref.ref(future)), how, engine)
    assert outcome(future) == expected
    assert engine.counts["clones_refused"] == refused
    assert future.refusal == (None if how == "fail" else CloneRefusal.STOPPING)


@pytest.mark.parametrize("how", ["fail", "abandon", "unrun"])
def test_a_clone_whose_future_was_dropped_or_settled_is_left_alone(how):
    engine = Engine()
    dropped = CloneCommand(3, 2, weakref.ref(CloneFuture()))
    assert dropped.future_ref() is None
    settle(dropped, how, engine)
    cancelled = CloneFuture()
    cancelled.cancel()
    settle(CloneCommand(3, 2, weakref.ref(cancelled)), how, engine)
    assert cancelled.cancelled() and engine.counts["clones_refused"] == 0
    if how != "unrun":  # only the engine settles a clone future, so an unrun one is never done
        done = CloneFuture()
        done.set_result("kept")
        settle(CloneCommand(3, 2, weakref.ref(done)), how, engine)
        assert done.result() == "kept"


@pytest.mark.parametrize(
    ("cls", "how", "expected"),
    [
        (StartCommand, "fail", ("error", "GenerationError: ValueError: boom")),
        (StartCommand, "abandon", ("error", "GenerationError: engine thread stopped: SystemExit")),
        (StartCommand, "unrun", ("cancelled", None)),
        (CancelCommand, "fail", ("error", "GenerationError: ValueError: boom")),
        (CancelCommand, "abandon", None),
        (CancelCommand, "unrun", None),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else v if isinstance(v, str) else None,
)
def test_a_generation_command_ends_its_generation(cls, how, expected):
    gen = generation()
    engine = Engine()
    settle(StartCommand(4, gen) if cls is StartCommand else CancelCommand(gen), how, engine)
    assert engine.finished == ([] if expected is None else [(gen, *expected)])
    assert engine.ran == []


@pytest.mark.parametrize(("how", "runs"), [("fail", False), ("abandon", False), ("unrun", True)])
def test_a_close_still_runs_when_the_engine_stops_with_it_queued(how, runs):
    engine = Engine()
    close = CloseCommand(5)
    settle(close, how, engine)
    assert engine.ran == ([close] if runs else []) and engine.finished == []


def test_unrun_open_and_barrier_leave_a_cancelled_future_cancelled():
    engine = Engine()
    for command in (OpenCommand(Future()), BarrierCommand(Future())):
        command.future.cancel()
        command.settle_unrun(engine.hooks)
        assert command.future.cancelled()
    BarrierCommand().settle_unrun(engine.hooks)  # a wake-up barrier has nobody to settle


def test_a_failing_handler_settles_its_caller_and_the_engine_carries_on(make_runner):
    class OpenFailsOnce(FakeExecutor):
        failed = False

        def open_session(self):
            if not self.failed:
                self.failed = True
                raise RuntimeError("open exploded")
            return super().open_session()

    runner = make_runner(OpenFailsOnce(vocab_size=VOCAB, max_sessions=1))
    with pytest.raises(RuntimeError, match="open exploded"):
        runner.open_session()
    s = runner.open_session()
    with pytest.raises(ResourceExhausted):
        runner.open_session()
    assert s.generate_async([1, 2], GenConfig(max_new_tokens=2)).wait(10).tokens
    assert runner.running
    runner.shutdown(10)
    with pytest.raises(Unavailable):
        runner.open_session()
