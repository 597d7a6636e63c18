"""Runner fixtures: a fake executor, runners that are always shut down, thread assertions."""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest

from engine_service.api.config import GenConfig
from engine_service.runtime.runner import Runner
from tests.unit.runtime.fake_executor import FakeExecutor

VOCAB = 97


@pytest.fixture
def fake() -> FakeExecutor:
    return FakeExecutor(vocab_size=VOCAB)


@pytest.fixture
def make_runner():
    """Factory ``make_runner(executor, **kw) -> Runner``; at teardown every runner is shut down and
    every executor call is asserted to have run on that runner's engine thread."""
    made: list[tuple[Runner, FakeExecutor]] = []

    def make(executor: FakeExecutor | None = None, **kwargs) -> Runner:
        executor = executor if executor is not None else FakeExecutor(vocab_size=VOCAB)
        runner = Runner(executor, **kwargs)
        made.append((runner, executor))
        return runner

    yield make
    for runner, executor in made:
        if executor.gate is not None:
            executor.gate.set()
        runner.shutdown(10)
        assert not runner.engine_thread.is_alive()
        assert executor.threads == {runner.engine_thread.ident}, "an executor call ran off the engine thread"


@pytest.fixture
def runner(make_runner, fake) -> Runner:
    return make_runner(fake)


class Recorder:
    """A callback that records updates and checks it runs on the engine thread."""

    def __init__(self, runner: Runner, then=None) -> None:
        self.runner = runner
        self.updates = []
        self.then = then
        self.wrong_thread = 0

    def __call__(self, update) -> None:
        if threading.current_thread() is not self.runner.engine_thread:
            self.wrong_thread += 1
        self.updates.append(update)
        if self.then is not None:
            self.then(update)

    @property
    def tokens(self) -> list[int]:
        return [t for u in self.updates for t in u.tokens]


@contextlib.contextmanager
def engine_paused(runner: Runner, fake: FakeExecutor):
    """Holds the engine inside ``execute`` of a throwaway 1-token generation while the body queues
    commands, so everything queued in the body is drained together before the next forward."""
    gate = threading.Event()
    fake.gate, fake.entered = gate, threading.Event()
    blocker = runner.open_session()
    handle = blocker.generate_async([1], GenConfig(max_new_tokens=1))
    assert fake.entered.wait(10)
    try:
        yield
    finally:
        fake.gate = None
        gate.set()
        handle.wait(10)
        blocker.close()


def collect_and_flush(runner: Runner) -> None:
    """Run finalizers of dropped sessions/futures, then wait for their closes to be handled.

    Twice: a command released by the engine while it handles the first barrier (e.g. an open whose
    future nobody kept) queues its session's close behind that barrier."""
    for _ in range(2):
        gc.collect()
        runner.flush(10)
