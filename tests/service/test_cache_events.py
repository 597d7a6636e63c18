"""CacheEvents over a real engine and prefix service on port 0 (issue 24 item 4).

- A store and the eviction it causes (max_entries 2) reach a client's stream in order, with increasing
  sequence numbers, the engine's name and instance id, the positions and the digest, never the tokens.
- Over two engines (round robin) each event names the engine that stored it, with that engine's instance id.
- A cancelled stream unsubscribes (the hub is empty again, nothing in flight); shutdown ends a stream.
- A subscriber that never reads gets a GAP marker and the generations do not wait for it.
- With tokens, bob's stream shows only his entries (replayed and live); the admin's shows alice's too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from clients.prefix_client import CacheEvent, CacheEventStream, PrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.content import content_digest
from engine_service.serving.auth import ServerSecurity
from engine_service.serving.tokens import TokenTable
from prefix_service.cache.events import EventKind
from prefix_service.engines.connect import connect_engine, connect_fleet
from prefix_service.fleet.routing import routing_policy
from prefix_service.gateway.tenancy import Tenancy
from prefix_service.rpc.server import create_server
from tests.service.helpers import wait_for

PROMPTS = ("First prompt, about apples.", "Second prompt, on bananas!", "Third prompt: cherries.")


class Collector:
    """Reads a CacheEvents stream in a thread into ``events``."""

    def __init__(self, stream: CacheEventStream) -> None:
        self.stream = stream
        self.events: list[CacheEvent] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for event in self.stream:
            self.events.append(event)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]

    def stop(self) -> None:
        self.stream.cancel()
        self.thread.join(5.0)
        assert not self.thread.is_alive()


def generate(client: PrefixClient, text: str, namespace: str = "app") -> None:
    client.generate(text=text, namespace=namespace, config=GenConfig(max_new_tokens=1)).collect()


def synced(client: PrefixClient) -> Collector:
    """A replaying stream, once its replay is complete (so it follows every later change)."""
    collector = Collector(client.cache_events(replay=True))
    assert wait_for(lambda: "synced" in collector.kinds())
    return collector


@pytest.fixture
def prefix(engine_factory, prefix_factory):
    return prefix_factory(engine_factory().address, max_entries=2)


def test_a_store_then_an_eviction_arrive_in_order(prefix) -> None:
    client = PrefixClient(prefix.address)
    collector = synced(client)
    for text in PROMPTS:  # the third store evicts the first (lru, max_entries 2)
        generate(client, text)
    assert wait_for(lambda: collector.kinds().count("stored") >= 3 and "evicted" in collector.kinds())
    collector.stop()
    events = collector.events
    assert [e.kind for e in events] == ["synced", "stored", "stored", "evicted", "stored"]
    assert [e.sequence for e in events] == [1, 2, 3, 4, 5]
    stats = client.stats()
    live = events[1:]
    assert {(e.engine, e.engine_instance_id) for e in live} == {
        (prefix.server.fleet.sole().backend.connection.address, stats.engine_instance_id)
    }
    first_tokens = client.lookup(text=PROMPTS[0], namespace="nobody").tokens  # the prompt's tokenization
    assert live[0].digest == live[2].digest == content_digest(first_tokens)  # the evicted one is the first
    assert live[0].positions == len(first_tokens) and live[0].namespace == "app"
    assert len({e.replica for e in events}) == 1 and all(e.time > 0 for e in live)


def test_each_event_names_its_engine(engine_factory) -> None:
    addresses = [engine_factory().address, engine_factory().address]
    fleet, pool = connect_fleet(
        lambda: set(addresses),
        policy=routing_policy("round_robin"),
        ready_timeout=10,
        max_entries=16,
        resolve_every_s=60,
    )
    server, port = create_server(fleet, "127.0.0.1:0", pool=pool)
    try:
        client = PrefixClient(f"127.0.0.1:{port}")
        collector = synced(client)
        for text in PROMPTS[:2]:
            generate(client, text)
        assert wait_for(lambda: collector.kinds().count("stored") >= 2)
        collector.stop()
        stored = [e for e in collector.events if e.kind == "stored"]
        engines = {e.name: e.instance_id for e in fleet.stats().engines}
        assert sorted(e.engine for e in stored) == sorted(addresses)  # one store on each
        assert all(e.engine_instance_id == engines[e.engine] for e in stored)
    finally:
        server.stop(0)


def test_a_cancelled_stream_unsubscribes(prefix) -> None:
    hub = prefix.server.servicer.events
    client = PrefixClient(prefix.address)
    collectors = [synced(client) for _ in range(3)]
    assert hub.subscribers == 3
    for collector in collectors:
        collector.stop()
    assert wait_for(lambda: hub.subscribers == 0)
    assert wait_for(lambda: prefix.server.in_flight.count == 0)
    generate(client, PROMPTS[0])  # publishing to nobody is fine
    assert hub.subscribers == 0


def test_shutdown_ends_the_stream(engine_factory, prefix_factory) -> None:
    prefix = prefix_factory(engine_factory().address)
    collector = synced(PrefixClient(prefix.address))
    started = time.monotonic()
    prefix.stop(60.0)
    collector.thread.join(60.0)
    assert not collector.thread.is_alive() and time.monotonic() - started < 30.0  # not the whole grace


def test_a_slow_consumer_gets_a_gap_and_does_not_slow_the_cache(engine_factory, prefix_factory) -> None:
    prefix = prefix_factory(engine_factory(max_sessions=32).address, max_entries=16)
    client = PrefixClient(prefix.address)
    texts = [f"Prompt number {i} for the slow consumer." for i in range(8)]

    def timed(chosen: list[str]) -> float:
        started = time.perf_counter()
        for text in chosen:
            generate(client, text)
        return time.perf_counter() - started

    baseline = timed(texts[:4])
    with prefix.server.servicer.events.subscribe(capacity=2) as slow:  # in the process: it never reads
        followed = timed(texts[4:])
        events = [slow.get(timeout=1.0) for _ in range(3)]
    assert [e.kind for e in events] == [EventKind.STORED, EventKind.STORED, EventKind.GAP]
    assert events[2].missed >= 2 and slow.dropped == events[2].missed
    assert followed < 5 * baseline + 2.0  # nobody waited for the reader (load may change between the phases)


TOKENS = {
    "alice-0123456789abcdefghij": "alice",
    "bob-0123456789abcdefghijkl": "bob",
    "ops-0123456789abcdefghijkl": "ops",
}
ALICE, BOB, OPS = list(TOKENS)


@pytest.fixture
def tenants(engine_factory, tmp_path) -> Iterator[int]:
    """A prefix service with tokens alice, bob and ops (--admin_owner), ``system`` shared; its port."""
    table_file = tmp_path / "tokens"
    table_file.write_text("".join(f"{t} {o}\n" for t, o in TOKENS.items()), encoding="utf-8")
    table_file.chmod(0o600)
    engine = engine_factory(max_sessions=16)
    gateway, channel = connect_engine(engine.address, max_entries=16, ready_timeout=10)
    server, port = create_server(
        gateway,
        "127.0.0.1:0",
        channel=channel,
        security=ServerSecurity(tokens=TokenTable.load(str(table_file))),
        tenancy=Tenancy.of(["system"], admin="ops"),
    )
    yield port
    server.stop(0)


def test_bob_sees_only_his_entries_the_admin_sees_all(tenants) -> None:
    alice, bob, ops = (PrefixClient(f"127.0.0.1:{tenants}", token=t) for t in (ALICE, BOB, OPS))
    secret = "My bank PIN is 4817, keep it safe."
    generate(alice, secret, "tenant-alice")  # before the streams: replayed
    watchers = {name: synced(c) for name, c in (("alice", alice), ("bob", bob), ("ops", ops))}
    generate(alice, secret + " And another.", "tenant-alice")
    generate(alice, "A shared prompt.", "system")
    generate(bob, "Bob's own prompt.", "tenant-bob")
    assert wait_for(lambda: watchers["ops"].kinds().count("stored") >= 4)
    assert wait_for(lambda: watchers["bob"].kinds().count("stored") >= 1)
    assert wait_for(lambda: watchers["alice"].kinds().count("stored") >= 2)
    time.sleep(0.2)  # anything late would show now
    for watcher in watchers.values():
        watcher.stop()

    def stored(name: str) -> list[CacheEvent]:
        return [e for e in watchers[name].events if e.kind == "stored"]

    alice_digests = {e.digest for e in stored("alice")}
    assert len(stored("bob")) == 1 and all("bob" in e.namespace for e in stored("bob"))
    assert not alice_digests & {e.digest for e in stored("bob")}
    assert len(stored("alice")) == 2 and all("alice" in e.namespace for e in stored("alice"))
    admin = stored("ops")  # negative control: the admin sees alice's, bob's and the shared entry
    assert len(admin) == 4 and alice_digests <= {e.digest for e in admin}
    assert sum(e.replayed for e in admin) == 1 and "system" in {e.namespace for e in admin}
    assert [e.sequence for e in watchers["bob"].events] == list(range(1, len(watchers["bob"].events) + 1))
