"""The replica hash ring (clients/replicas.py) and the route key on PrefixClient calls.

Ring: deterministic across processes (a fresh interpreter with another PYTHONHASHSEED maps keys the same),
balanced, and adding or removing one of N replicas moves about 1/N of the keys, only to or from that
replica. Client: every namespaced call goes to the replica the ring picks and carries
``forkline-route-key: <namespace>``, checked on real gRPC servers (a recording fake PrefixCache servicer
on 127.0.0.1:0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from clients.prefix_client import ROUTE_KEY_HEADER, PrefixClient
from clients.replicas import DEFAULT_VNODES, HashRing, ReplicatedPrefixClient, ring_hash
from engine_service.api.config import GenConfig
from protos import engine_pb2, prefix_pb2, prefix_pb2_grpc

REPLICAS = [f"prefix-{i}.forkline:50052" for i in range(4)]
KEYS = [f"tenant-{i}" for i in range(20_000)]
ROOT = Path(__file__).resolve().parents[3]


def mapping(ring: HashRing) -> dict[str, str]:
    return {k: ring.replica_for(k) for k in KEYS}


def test_same_mapping_in_another_process_with_another_hash_seed() -> None:
    keys = KEYS[:300] + ["", "ünïcode", "a" * 1000]
    script = (
        "import json, sys; from clients.replicas import HashRing; keys = json.load(sys.stdin); "
        f"r = HashRing({REPLICAS!r}); print(json.dumps([r.replica_for(k) for k in keys]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(keys),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=True,
        timeout=60,
    ).stdout
    ring = HashRing(REPLICAS)
    assert json.loads(out) == [ring.replica_for(k) for k in keys]


def test_order_of_the_replica_list_does_not_matter() -> None:
    assert mapping(HashRing(REPLICAS)) == mapping(HashRing(list(reversed(REPLICAS))))


def test_pinned_values_never_change() -> None:
    # the ring is a contract between clients written at different times: a change of hash, personalisation
    # or point naming would move every namespace to another replica's (cold) cache
    assert ring_hash("") == 6337639261352260557
    assert ring_hash("tenant-1") == 3844322475425807551
    ring = HashRing(["a:1", "b:1", "c:1"])
    assert [ring.replica_for(f"ns{i}") for i in range(8)] == [
        "c:1",
        "a:1",
        "c:1",
        "a:1",
        "c:1",
        "a:1",
        "b:1",
        "a:1",
    ]


def test_keys_spread_evenly() -> None:
    counts = {r: 0 for r in REPLICAS}
    for replica in mapping(HashRing(REPLICAS)).values():
        counts[replica] += 1
    fair = len(KEYS) / len(REPLICAS)
    assert all(0.8 * fair < n < 1.2 * fair for n in counts.values()), counts


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_adding_one_replica_moves_about_one_nth_of_the_keys_and_only_to_it(n: int) -> None:
    names = [f"10.0.0.{i}:50052" for i in range(n)]
    before = HashRing(names)
    after = before.with_replica("10.0.1.99:50052")
    old, new = mapping(before), mapping(after)
    moved = [k for k in KEYS if old[k] != new[k]]
    assert all(new[k] == "10.0.1.99:50052" for k in moved)  # nothing moves between the old replicas
    share = len(moved) / len(KEYS)
    assert 0.6 / (n + 1) < share < 1.4 / (n + 1), share


def test_removing_one_replica_moves_only_its_keys() -> None:
    before = HashRing(REPLICAS)
    after = before.without_replica(REPLICAS[2])
    old, new = mapping(before), mapping(after)
    moved = {k for k in KEYS if old[k] != new[k]}
    assert moved == {k for k in KEYS if old[k] == REPLICAS[2]}
    assert 0.6 / 4 < len(moved) / len(KEYS) < 1.4 / 4


def test_control_a_modulo_mapping_fails_the_movement_check() -> None:
    # negative control for the two tests above: hash-mod-N (no ring) moves ~N/(N+1) of the keys on a join
    def modulo(names: list[str]) -> dict[str, str]:
        return {k: names[ring_hash(k) % len(names)] for k in KEYS}

    old, new = modulo(REPLICAS), modulo([*REPLICAS, "extra:1"])
    share = sum(old[k] != new[k] for k in KEYS) / len(KEYS)
    assert share > 1.4 / 5


@pytest.mark.parametrize("bad", [[], ["a:1", "a:1"], ["a:1", ""]])
def test_bad_replica_lists_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        HashRing(bad)


def test_bad_vnodes_and_unknown_removal_are_refused() -> None:
    with pytest.raises(ValueError):
        HashRing(["a:1"], vnodes=0)
    with pytest.raises(ValueError):
        HashRing(["a:1"]).without_replica("b:1")
    assert HashRing(["a:1"]).vnodes == DEFAULT_VNODES


# --- over gRPC: a recording fake prefix service per replica ---------------------------------------------


class RecordingPrefixCache(prefix_pb2_grpc.PrefixCacheServicer):
    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, str, dict[str, str]]] = []  # (rpc, namespace, metadata)
        self.lock = threading.Lock()

    def _record(self, rpc: str, namespace: str, context) -> None:
        with self.lock:
            self.calls.append((rpc, namespace, dict(context.invocation_metadata())))

    def Lookup(self, request, context):
        self._record("Lookup", request.namespace, context)
        return prefix_pb2.LookupResponse(reused=0)

    def Insert(self, request, context):
        self._record("Insert", request.namespace, context)
        return prefix_pb2.InsertResponse(stored=True)

    def Generate(self, request, context):
        self._record("Generate", request.namespace, context)
        yield engine_pb2.GenerateEvent(done=engine_pb2.DoneEvent(finish_reason="length"))

    def Stats(self, request, context):
        self._record("Stats", "", context)
        return prefix_pb2.StatsResponse(entries=len(self.name))

    def Clear(self, request, context):
        self._record("Clear", "", context)
        return prefix_pb2.ClearResponse(released=1)


@pytest.fixture
def fake_replicas():
    servers, fakes = [], {}
    for i in range(3):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        fake = RecordingPrefixCache(f"r{i}")
        prefix_pb2_grpc.add_PrefixCacheServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        fakes[f"127.0.0.1:{port}"] = fake
    yield fakes
    for server in servers:
        server.stop(None)


def test_prefix_client_sends_the_route_key_with_namespaced_calls(fake_replicas) -> None:
    address, fake = next(iter(fake_replicas.items()))
    with PrefixClient(address, owner="alice") as client:
        client.lookup([1, 2, 3], namespace="team-a")
        client.insert([1, 2, 3], "s1", namespace="team-b")
        list(client.generate([1, 2], namespace="team-c"))
        client.lookup([1])  # the default namespace is a route key too: ""
        client.stats()
    by_rpc = [(rpc, ns, md.get(ROUTE_KEY_HEADER), md.get("forkline-owner")) for rpc, ns, md in fake.calls]
    assert by_rpc == [
        ("Lookup", "team-a", "team-a", "alice"),
        ("Insert", "team-b", "team-b", "alice"),
        ("Generate", "team-c", "team-c", "alice"),
        ("Lookup", "", "", "alice"),
        ("Stats", "", None, "alice"),
    ]


def test_replicated_client_sends_each_namespace_to_its_ring_replica(fake_replicas) -> None:
    namespaces = [f"tenant-{i}" for i in range(30)]
    with ReplicatedPrefixClient(list(fake_replicas), owner="bob") as client:
        for ns in namespaces:
            client.lookup([1, 2], namespace=ns)
            client.insert_detailed([1, 2], "s", namespace=ns)
            list(client.generate([1], namespace=ns, config=GenConfig(max_new_tokens=1)))
        assert client.clear() == 3
        assert set(client.stats()) == set(fake_replicas)
    ring = HashRing(list(fake_replicas))
    served = set()
    for address, fake in fake_replicas.items():
        for rpc, ns, md in fake.calls:
            if rpc in ("Lookup", "Insert", "Generate"):
                assert ring.replica_for(ns) == address, (rpc, ns)
                assert md[ROUTE_KEY_HEADER] == ns and md["forkline-owner"] == "bob"
                served.add(address)
    assert len(served) == 3  # 30 namespaces reached every replica
    assert sum(rpc == "Lookup" for f in fake_replicas.values() for rpc, _, _ in f.calls) == 30


def test_replicated_client_borrows_given_clients_and_refuses_strays(fake_replicas) -> None:
    addresses = list(fake_replicas)
    borrowed = PrefixClient(addresses[0])
    client = ReplicatedPrefixClient(addresses, clients={addresses[0]: borrowed})
    assert client.clients[addresses[0]] is borrowed
    client.close()
    borrowed.lookup([1], namespace="still-open")  # close() left the borrowed channel alone
    borrowed.close_channel()
    with pytest.raises(ValueError, match="not in the list"):
        ReplicatedPrefixClient(addresses[:1], clients={"elsewhere:1": borrowed})


def test_the_fallback_order_is_the_ring_without_the_replicas_before() -> None:
    replicas = [f"replica-{i}:50052" for i in range(4)]
    ring = HashRing(replicas)
    for key in (f"namespace-{i}" for i in range(200)):
        order = ring.replicas_for(key)
        assert sorted(order) == sorted(replicas) and order[0] == ring.replica_for(key)
        assert order[1] == ring.without_replica(order[0]).replica_for(key)
        assert order[2] == ring.without_replica(order[0]).without_replica(order[1]).replica_for(key)


class FlakyClient:
    """A PrefixClient stand-in that answers ``lookup`` with its name, or raises Unavailable while down."""

    def __init__(self, name: str) -> None:
        self.name, self.up, self.calls = name, True, 0

    def lookup(self, tokens=None, *, namespace: str = "", **kwargs):
        from engine_service.api.errors import Unavailable

        self.calls += 1
        if not self.up:
            raise Unavailable(f"{self.name} is down")
        return self.name


def test_a_namespace_rehomes_while_its_replica_is_down_and_returns_after_retry_after() -> None:
    addresses = ["r0:1", "r1:1", "r2:1"]
    now = [0.0]
    fakes = {a: FlakyClient(a) for a in addresses}
    client = ReplicatedPrefixClient(addresses, clients=fakes, retry_after_s=2.0, clock=lambda: now[0])
    home, stand_in, _ = client.ring.replicas_for("team-a")
    assert client.lookup([1], namespace="team-a") == home
    fakes[home].up = False
    assert client.lookup([1], namespace="team-a") == stand_in  # re-homed within the same call
    calls = fakes[home].calls
    assert client.lookup([1], namespace="team-a") == stand_in and fakes[home].calls == calls  # passed over
    assert client.down() == [home] and client.rehomed == 2
    fakes[home].up = True
    now[0] = 2.5
    assert client.lookup([1], namespace="team-a") == home and client.down() == []  # back home
    for fake in fakes.values():
        fake.up = False
    with pytest.raises(Exception, match="down"):
        client.lookup([1], namespace="team-a")  # every replica down: the last one's error
