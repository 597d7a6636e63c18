"""HandleSweeper: closes the sessions of expired handles, and only those."""

from __future__ import annotations

from engine_service.sessions.sweeper import HandleSweeper
from tests.unit.sessions.conftest import resident, run, started


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_sweep_closes_only_expired_sessions(make_sessions) -> None:
    clock = Clock()
    engine = make_sessions(idle_timeout_s=30.0, clock=clock)
    old = started(run(engine, "alice", [5, 6, 7], max_new_tokens=1, keep_session=True)).session
    clock.now = 20.0
    new = started(run(engine, "bob", [5, 6, 7], max_new_tokens=1, keep_session=True)).session
    sweeper = HandleSweeper(engine.registry)
    assert sweeper.sweep() == 0 and resident(engine) == 2  # negative control: nothing idle yet
    clock.now = 31.0
    assert sweeper.sweep() == 1 and resident(engine) == 1
    assert engine.describe("bob", new).position == 3
    assert engine.registry.count("alice") == 0 and old not in [
        r.handle for r in engine.registry.release_all()
    ]


def test_no_thread_without_expiry(sessions) -> None:
    sweeper = HandleSweeper(sessions.registry)
    sweeper.start()
    assert not sweeper._thread.is_alive()
