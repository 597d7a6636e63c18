"""A lookup's clone runs outside the cache's lock: an engine answers a Clone only between forwards
(up to a long prefill chunk), and every other lookup, insert and stats call must not wait for that.
The backend's clone blocks on a gate here; each test reads what the returned session really holds."""

from __future__ import annotations

import threading

import pytest

from prefix_service.cache.prefix_cache import PrefixCache
from tests.unit.prefix.fakes import FakeBackend, FakeSession

NS = "app"
DOC = tuple(range(10, 30))
OTHER = tuple(range(100, 120))
WAIT_S = 5.0


class GatedBackend(FakeBackend):
    """Clones wait for ``gate`` (set: no wait) and say when they started."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.cloning = threading.Event()

    def clone(self, handle: FakeSession, upto: int) -> FakeSession | None:
        self.cloning.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        return super().clone(handle, upto)


@pytest.fixture
def backend() -> GatedBackend:
    return GatedBackend()


def held_lookup(
    backend: GatedBackend, cache: PrefixCache, tokens: tuple[int, ...]
) -> tuple[threading.Thread, list]:
    """Start a lookup whose clone waits on the gate; returns once the clone has begun."""
    backend.gate.clear()
    backend.cloning.clear()
    out: list = []
    thread = threading.Thread(target=lambda: out.append(cache.lookup(NS, tokens)))
    thread.start()
    assert backend.cloning.wait(WAIT_S)
    return thread, out


def in_time(fn) -> bool:
    """Whether ``fn`` returns within a second on another thread (it would block on a held lock)."""
    done = threading.Event()
    threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
    return done.wait(1.0)


def test_inserts_lookups_and_stats_proceed_while_a_clone_waits(backend, cache):
    cache.insert(NS, DOC, backend.open(DOC))
    thread, out = held_lookup(backend, cache, DOC + (1,))
    try:
        other = backend.open(OTHER)
        assert in_time(lambda: cache.insert(NS, OTHER, other))
        assert in_time(cache.stats)
        assert in_time(lambda: cache.lookup(NS, (7, 8, 9)))  # a miss: no clone to wait for
    finally:
        backend.gate.set()
        thread.join(WAIT_S)
    match = out[0].match
    assert match.session.tokens == DOC and match.reused == len(DOC)
    assert cache.stats().hits == 1 and len(cache.entries(NS)) == 2


def test_an_entry_cleared_during_its_clone_still_serves_that_clone_and_is_closed_once(backend, cache):
    snapshot = backend.open(DOC)
    cache.insert(NS, DOC, snapshot)
    thread, out = held_lookup(backend, cache, DOC + (1,))
    try:
        assert cache.clear() == 1
        assert snapshot.close_calls == 1
        snapshot.closed = False  # the engine answers the queued Clone before the Close
    finally:
        backend.gate.set()
        thread.join(WAIT_S)
    match = out[0].match
    assert match is not None and match.session.tokens == DOC  # the caller's clone, as cloned
    assert snapshot.close_calls == 1 and cache.entries(NS) == []  # not refreshed back, not dropped twice


def test_a_snapshot_closed_before_its_clone_is_a_miss_and_dropped_once(backend, cache):
    snapshot = backend.open(DOC)
    cache.insert(NS, DOC, snapshot)
    thread, out = held_lookup(backend, cache, DOC + (1,))
    try:
        assert cache.clear() == 1  # the engine ran the Close first: the clone finds no session
    finally:
        backend.gate.set()
        thread.join(WAIT_S)
    assert out[0].match is None
    assert snapshot.close_calls == 1 and cache.entries(NS) == []
