"""Cache events (``prefix_service/cache/events.py``): what a PrefixCache stores and drops reaches each
subscriber in order, filtered by scope, without tokens; a full queue drops to a GAP marker instead of
blocking the cache; closing ends a waiting reader and unsubscribes; replay starts with the entries."""

from __future__ import annotations

import threading
import time

import pytest

from engine_service.api.content import content_digest
from engine_service.api.errors import ResourceExhausted
from prefix_service.cache import events
from prefix_service.cache.events import CacheEvent, EventHub, EventKind
from prefix_service.cache.prefix_cache import PrefixCache
from tests.unit.prefix.fakes import FakeBackend

ENGINE = "engine-a:50051"


def followed(backend: FakeBackend, max_entries: int = 2) -> tuple[PrefixCache, EventHub]:
    cache = PrefixCache(backend, max_entries=max_entries)
    hub = EventHub()
    hub.attach(cache, ENGINE, lambda: "instance-1")
    return cache, hub


def store(backend: FakeBackend, cache: PrefixCache, namespace: str, tokens: tuple[int, ...]) -> None:
    assert cache.insert(namespace, tokens, backend.open(tokens)).stored


def drain(subscription, n: int) -> list[CacheEvent]:
    events = [subscription.get(timeout=1.0) for _ in range(n)]
    assert None not in events, events
    return events


def test_store_then_eviction_arrive_in_order_with_engine_and_digest(backend):
    cache, hub = followed(backend, max_entries=2)
    with hub.subscribe() as subscription:
        first, second, third = (1, 2, 3), (4, 5, 6, 7), (8, 9)
        for tokens in (first, second, third):  # the third evicts the first (lru)
            store(backend, cache, "app", tokens)
        events = drain(subscription, 4)
        assert subscription.get(timeout=0.05) is None
    assert [e.kind for e in events] == [EventKind.STORED] * 3 + [EventKind.EVICTED]
    assert [e.sequence for e in events] == [1, 2, 3, 4]
    assert {(e.engine, e.instance_id, e.scope, e.replica) for e in events} == {
        (ENGINE, "instance-1", "app", hub.replica)
    }
    assert events[3].positions == 3 and events[3].digest == content_digest(first)
    assert [e.positions for e in events[:3]] == [3, 4, 2]
    assert all(e.time > 0 for e in events)


def test_clear_and_dead_entries_are_reported(backend):
    cache, hub = followed(backend, max_entries=8)
    store(backend, cache, "app", (1, 2, 3))
    store(backend, cache, "other", (4, 5, 6))
    dead = backend.open((7, 8, 9))
    assert cache.insert("app", (7, 8, 9), dead).stored
    with hub.subscribe() as subscription:
        backend.close(next(e.snapshot for e in cache.entries() if e.tokens == (7, 8, 9)))
        assert cache.lookup("app", (7, 8, 9, 10)).match is None  # its handle is gone: dropped
        assert cache.clear(lambda scope: scope == "other") == 1
        kinds = [(e.kind, e.scope) for e in drain(subscription, 2)]
    assert kinds == [(EventKind.DROPPED, "app"), (EventKind.CLEARED, "other")]


def test_a_subscriber_sees_only_the_scopes_it_may(backend):
    cache, hub = followed(backend, max_entries=8)
    with hub.subscribe(lambda scope: scope == "bob") as bob, hub.subscribe() as admin:
        store(backend, cache, "alice", (1, 2, 3))
        store(backend, cache, "bob", (4, 5, 6))
        assert [e.scope for e in drain(bob, 1)] == ["bob"] and bob.get(timeout=0.05) is None
        assert [e.scope for e in drain(admin, 2)] == ["alice", "bob"]  # negative control


def timed_inserts(backend: FakeBackend, cache: PrefixCache, n: int = 200) -> float:
    started = time.perf_counter()
    for i in range(n):
        store(backend, cache, "app", (1, 2, i + 3))
    return time.perf_counter() - started


def test_a_slow_subscriber_gets_a_gap_and_never_slows_the_cache(backend):
    unfollowed = FakeBackend()
    baseline = timed_inserts(unfollowed, PrefixCache(unfollowed, max_entries=10_000))  # no events at all
    cache, hub = followed(backend, max_entries=10_000)
    with hub.subscribe(capacity=4) as slow:
        elapsed = timed_inserts(backend, cache)
        events = drain(slow, 5)
        assert slow.get(timeout=0.05) is None
        assert slow.dropped == 196
    assert [e.kind for e in events] == [EventKind.STORED] * 4 + [EventKind.GAP]
    assert events[4].missed == 196 and events[4].sequence == 200  # the numbers it stands for are spent
    # nobody read during the 200 inserts: none waited for the reader (a wait would be a timeout each)
    assert elapsed < 5 * baseline + 1.0


def test_events_after_a_gap_follow_it(backend):
    cache, hub = followed(backend, max_entries=100)
    with hub.subscribe(capacity=1) as subscription:
        store(backend, cache, "app", (1, 2, 3))
        store(backend, cache, "app", (1, 2, 4))  # dropped
        first, gap = drain(subscription, 2)
        store(backend, cache, "app", (1, 2, 5))
        (after,) = drain(subscription, 1)
    assert (first.sequence, gap.kind, gap.missed, gap.sequence) == (1, EventKind.GAP, 1, 2)
    assert (after.kind, after.sequence, after.positions) == (EventKind.STORED, 3, 3)


def test_close_wakes_the_reader_and_unsubscribes(backend):
    _, hub = followed(backend)
    subscription = hub.subscribe()
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(subscription.get()))
    reader.start()
    time.sleep(0.05)
    assert hub.subscribers == 1
    subscription.close()
    reader.join(30)
    assert not reader.is_alive() and got == [None]
    assert hub.subscribers == 0


def test_hub_close_ends_every_subscription_and_later_ones(backend):
    _, hub = followed(backend)
    subscriptions = [hub.subscribe() for _ in range(3)]
    hub.close()
    assert all(s.get(timeout=1.0) is None for s in subscriptions) and hub.subscribers == 0
    assert hub.subscribe().get(timeout=0.01) is None


def test_no_subscriber_no_work_and_a_bound_on_subscribers(backend, monkeypatch):
    cache, hub = followed(backend, max_entries=8)

    def hashed(tokens):
        raise AssertionError("hashed with nobody subscribed")

    monkeypatch.setattr(events, "_digest", hashed)
    store(backend, cache, "app", (1, 2, 3))  # nobody listens: not even the digest is computed
    with hub.subscribe(lambda scope: scope == "other"):
        store(backend, cache, "app", (4, 5, 6))  # nobody takes this scope
        with hub.subscribe(), pytest.raises(AssertionError):  # negative control: a taker hashes
            store(backend, cache, "app", (7, 8, 9))
    monkeypatch.undo()
    hub.max_subscribers = 2
    with hub.subscribe(), hub.subscribe(), pytest.raises(ResourceExhausted):
        hub.subscribe()
    assert hub.subscribers == 0


def test_replay_lists_the_entries_then_synced_then_live_events(backend):
    cache, hub = followed(backend, max_entries=8)
    store(backend, cache, "app", (1, 2, 3))
    store(backend, cache, "hidden", (4, 5))
    with hub.subscribe(lambda scope: scope == "app", replay=True) as subscription:
        store(backend, cache, "app", (6, 7, 8, 9))
        events = drain(subscription, 3)
    assert [(e.kind, e.replayed, e.positions) for e in events] == [
        (EventKind.STORED, True, 3),
        (EventKind.SYNCED, False, 0),
        (EventKind.STORED, False, 4),
    ]
    assert [e.sequence for e in events] == [1, 2, 3]


def test_detached_cache_publishes_nothing(backend):
    cache, hub = followed(backend, max_entries=8)
    with hub.subscribe() as subscription:
        hub.detach(cache)
        store(backend, cache, "app", (1, 2, 3))
        assert subscription.get(timeout=0.05) is None


def test_retain_detaches_the_caches_of_engines_that_left(backend):
    kept, hub = followed(backend, max_entries=8)
    left = PrefixCache(backend, max_entries=8)
    hub.attach(left, "engine-b:50051", lambda: "instance-2")
    store(backend, kept, "app", (1, 2, 3))
    store(backend, left, "app", (4, 5, 6))
    with hub.subscribe(replay=True) as before:
        assert {e.engine for e in drain(before, 2)} == {ENGINE, "engine-b:50051"}  # control: both replayed
    hub.retain([kept])
    with hub.subscribe(replay=True) as after:
        replayed, synced = drain(after, 2)
        store(backend, left, "app", (7, 8, 9))
        assert after.get(timeout=0.05) is None
    assert (replayed.engine, synced.kind) == (ENGINE, EventKind.SYNCED)
