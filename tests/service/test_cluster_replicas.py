"""An HA prefix tier with real processes: two prefix-service replicas (owners ``forkline-prefix-0`` and
``-1``) over one engine that lists no owner, only ``--persistent_owner_prefix forkline-prefix-`` (so a
replica joins without editing the engine), and a :class:`ReplicatedPrefixClient`. Killing a
namespace's replica re-homes the namespace to the other (served, cold there, then warm); restarting it
at the same address brings the namespace home. Control: a plain client of the killed replica gets
UNAVAILABLE, so the re-homing is what kept the calls working."""

from __future__ import annotations

import time

import pytest

from clients.prefix_client import PrefixClient
from clients.replicas import ReplicatedPrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.errors import Unavailable
from engine_service.api.owners import PersistentOwners
from tests.service.helpers import wait_for
from tests.service.test_cluster_dns import free_port
from tests.service.test_engine_restart import ServiceProcess

PREFIX = "forkline-prefix-"


class Replica:
    def __init__(self, index: int, engine: str, port: int) -> None:
        self.address = f"127.0.0.1:{port}"
        self.process = ServiceProcess(
            "prefix_service",
            *(
                "--engine",
                engine,
                "--owner",
                f"{PREFIX}{index}",
                "--port",
                str(port),
                "--engine_share",
                "0.4",
            ),
        )
        assert self.process.listening() == self.address


def run(client: ReplicatedPrefixClient, prompt: list[int], namespace: str) -> tuple[str, int]:
    """(replica that served, reused positions) of a gateway generation."""
    stream = client.generate(
        prompt, namespace=namespace, config=GenConfig(max_new_tokens=2, temperature=0.0), ignore_eos=True
    )
    out = stream.collect()
    return stream.replica, out.done.reused_positions


@pytest.fixture
def engine(engine_factory):
    return engine_factory(max_sessions=32, persistent_owners=PersistentOwners((), (PREFIX,)))


def test_a_namespace_rehomes_while_its_replica_is_down_and_comes_back(engine) -> None:
    ports = [free_port(), free_port()]
    replicas = [Replica(i, engine.address, ports[i]) for i in range(2)]
    addresses = [r.address for r in replicas]
    client = ReplicatedPrefixClient(addresses, owner="client", retry_after_s=0.5)
    namespace = next(ns for ns in (f"team-{i}" for i in range(100)) if client.replica_for(ns) == addresses[0])
    home, other = addresses
    prompt = [ord(c) for c in "A system prompt of the team whose replica goes away. "]
    try:
        assert run(client, prompt, namespace) == (home, 0)
        assert run(client, prompt + [65], namespace) == (home, len(prompt))  # warm at home

        replicas[0].process.kill()
        with PrefixClient(home, owner="client", timeout=5) as direct, pytest.raises(Unavailable):
            direct.lookup(prompt, namespace=namespace)  # control: the home replica is down
        assert run(client, prompt + [66], namespace) == (other, 0)  # re-homed: served, cold there
        assert run(client, prompt + [67], namespace) == (other, len(prompt))  # warm on the stand-in
        assert client.lookup(prompt + [68], namespace=namespace).reused == len(prompt)
        assert client.rehomed >= 3

        replicas[0] = Replica(0, engine.address, ports[0])  # back at the same address
        back = time.monotonic()
        # past retry_after_s the home replica is tried first again; its channel reconnects within ~1 s
        assert wait_for(lambda: run(client, prompt + [69], namespace)[0] == home, timeout=60)
        assert time.monotonic() - back < 30.0  # back home, not after the whole wait
        assert run(client, prompt + [70], namespace) == (home, len(prompt))
        assert client.down() == []
    finally:
        client.close()
        for replica in replicas:
            replica.process.kill()
