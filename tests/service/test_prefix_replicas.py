"""Two prefix-service replicas (real processes, each with its own owner id) over the same two engines:
neither sees or disturbs the other's entries, and after ``kill -9`` of one, its restart releases
exactly its own leftovers in every engine while the other keeps serving hits."""

from __future__ import annotations

import grpc
import pytest

from protos import engine_pb2 as epb
from protos import prefix_pb2, prefix_pb2_grpc
from tests.service.helpers import in_process_tokens, wait_for
from tests.service.test_engine_restart import ServiceProcess

OWNERS = ("replica-1", "replica-2")
NEW_TOKENS = 3


class Replica:
    def __init__(self, owner: str, engines: list[str]) -> None:
        args = [a for address in engines for a in ("--engine", address)]
        self.process = ServiceProcess(
            "prefix_service",
            *args,
            "--owner",
            owner,
            "--port",
            "0",
            "--engine_share",
            "0.4",
            "--no-cache_generated",  # prompt snapshots only: the test counts them
        )
        self.channel = grpc.insecure_channel(self.process.listening())
        self.stub = prefix_pb2_grpc.PrefixCacheStub(self.channel)

    def generate(self, prompt: list[int]) -> tuple[list[int], epb.DoneEvent]:
        request = prefix_pb2.GatewayGenerateRequest(
            tokens=epb.TokenIds(ids=prompt),
            config=epb.GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
        )
        events = list(self.stub.Generate(request, metadata=(("forkline-owner", "client"),), timeout=30))
        return [t for e in events if e.HasField("tokens") for t in e.tokens.ids], events[-1].done

    def entries(self) -> int:
        return self.stub.Stats(prefix_pb2.StatsRequest(), timeout=10).entries

    def kill(self) -> None:
        self.channel.close()
        self.process.kill()


def prompts(tag: str) -> list[list[int]]:
    return [[ord(c) for c in f"{tag}{i} a prompt stored by one replica only. "] for i in range(3)]


@pytest.fixture
def engines(engine_factory):
    return [engine_factory(max_sessions=16, persistent_owners=OWNERS) for _ in range(2)]


def held(engines, owner: str) -> int:
    """Sessions ``owner`` holds over every engine (the engines' own registries)."""
    return sum(e.deps.registry.usage(owner).sessions for e in engines)


def test_replicas_share_engines_without_interfering_and_reclaim_only_their_own(engines) -> None:
    addresses = [e.address for e in engines]
    one, two = Replica(OWNERS[0], addresses), Replica(OWNERS[1], addresses)
    try:
        for p in prompts("P"):
            one.generate(p)
        for p in prompts("Q"):
            two.generate(p)
        assert one.entries() == 3 and two.entries() == 3
        assert held(engines, OWNERS[0]) == 3 and held(engines, OWNERS[1]) == 3
        # the same prompt through the other replica: that replica's own cache, a miss there
        assert two.generate(prompts("P")[0])[1].reused_positions == 0
        assert wait_for(lambda: held(engines, OWNERS[1]) == 4)

        one.kill()  # kill -9: nothing released
        assert held(engines, OWNERS[0]) == 3
        q = prompts("Q")[1] + [ord("!")]
        tokens, done = two.generate(q)
        assert done.reused_positions == len(q) - 1 and tokens == in_process_tokens(q, NEW_TOKENS)

        # q's own prompt snapshot was stored too, and replaced Q1's, which it covers (flat layers)
        assert wait_for(lambda: held(engines, OWNERS[1]) == 4 and two.entries() == 4)
        one = Replica(OWNERS[0], addresses)  # its start releases what the killed one left
        assert held(engines, OWNERS[0]) == 0 and one.entries() == 0
        assert held(engines, OWNERS[1]) == 4 and two.entries() == 4  # the other replica untouched
        q = prompts("Q")[2] + [ord("?")]
        assert two.generate(q)[1].reused_positions == len(q) - 1
        p = prompts("P")[0] + [ord("?")]
        assert one.generate(p)[1].reused_positions == 0  # its entries went with its leftovers
    finally:
        one.kill()
        two.kill()
