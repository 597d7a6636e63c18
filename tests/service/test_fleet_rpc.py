"""One prefix service in front of several real engines (in-process servers on the tiny model): a
request goes to the engine that holds its prefix and continues exactly like a cold run; an engine
that goes away is left for another before the first token; engines join and leave through the pool;
an engine of another model is held out; Lookup and Insert name engines."""

from __future__ import annotations

import grpc
import pytest

from prefix_service.engines.connect import connect_fleet
from prefix_service.engines.engine_targets import DnsTarget, engine_targets
from prefix_service.fleet.routing import routing_policy
from prefix_service.rpc.server import create_server
from protos import engine_pb2 as epb
from protos import engine_pb2_grpc, prefix_pb2, prefix_pb2_grpc
from tests.service.helpers import in_process_tokens, wait_for

NEW_TOKENS = 4
OWNER = (("forkline-owner", "alice"),)


class FleetService:
    def __init__(self, targets, routing: str = "cache_aware") -> None:
        self.targets = targets
        self.fleet, self.pool = connect_fleet(
            lambda: set(self.targets),
            policy=routing_policy(routing),
            ready_timeout=10,
            max_entries=16,
            resolve_every_s=60,
            cache_generated=False,  # the engines' shares hold 4 entries each: the prompts fill them
        )
        self.server, port = create_server(self.fleet, "127.0.0.1:0", pool=self.pool)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = prefix_pb2_grpc.PrefixCacheStub(self.channel)

    def generate(self, prompt: list[int], namespace: str = "ns") -> tuple[list[int], epb.DoneEvent]:
        request = prefix_pb2.GatewayGenerateRequest(
            namespace=namespace,
            tokens=epb.TokenIds(ids=prompt),
            config=epb.GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
        )
        tokens: list[int] = []
        done = None
        for event in self.stub.Generate(request, metadata=OWNER, timeout=30):
            if event.HasField("tokens"):
                tokens += event.tokens.ids
            if event.HasField("done"):
                done = event.done
        assert done is not None
        return tokens, done

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(0)


@pytest.fixture
def two_engines(engine_factory):
    return engine_factory(), engine_factory()


@pytest.fixture
def service(two_engines):
    svc = FleetService([e.address for e in two_engines])
    yield svc
    svc.stop()


def prompts(n: int) -> list[list[int]]:
    """Prompts that differ from the first token (so that each is a miss at first)."""
    return [[ord(c) for c in f"{chr(65 + i)} prompt: the rest of a system prompt. "] for i in range(n)]


def test_continuations_go_to_the_engine_holding_the_prefix_and_match_cold(service, two_engines) -> None:
    first = {}
    for p in prompts(4):
        tokens, done = service.generate(p)
        assert tokens == in_process_tokens(p, NEW_TOKENS)
        first[tuple(p)] = done.engine
    assert set(first.values()) == {e.address for e in two_engines}  # misses spread over both engines
    for p in prompts(4):
        longer = p + [ord(c) for c in "and more"]
        tokens, done = service.generate(longer)
        assert done.engine == first[tuple(p)]
        assert done.reused_positions == len(p)
        assert tokens == in_process_tokens(longer, NEW_TOKENS)  # a hit continues exactly like a cold run
    stats = service.stub.Stats(prefix_pb2.StatsRequest())
    # each continuation's snapshot covers its prompt's (flat layers): the shorter one is dropped
    assert stats.routing == "cache_aware" and stats.entries == 4
    assert sorted(e.entries for e in stats.engines) == [2, 2]
    assert sum(e.routed for e in stats.engines) == 8 and all(e.routable for e in stats.engines)


def test_negative_control_round_robin_recomputes(two_engines) -> None:
    svc = FleetService([e.address for e in two_engines], routing="round_robin")
    try:
        ps = prompts(3)
        for p in ps:
            svc.generate(p)
        reused = [svc.generate(p + [33])[1].reused_positions for p in ps]
        assert reused.count(0) >= 1  # a b a, then b a b: the continuations miss
    finally:
        svc.stop()


def test_lookup_names_the_engine_and_its_session_continues_there(service) -> None:
    p = prompts(1)[0]
    _, done = service.generate(p)
    reply = service.stub.Lookup(
        prefix_pb2.LookupRequest(namespace="ns", tokens=epb.TokenIds(ids=p + [65])), metadata=OWNER
    )
    assert reply.engine == done.engine and reply.reused == len(p)
    with grpc.insecure_channel(reply.engine) as channel:  # the engine it names holds the session
        engine = engine_pb2_grpc.EngineStub(channel)
        events = list(
            engine.Generate(
                epb.GenerateRequest(
                    session=reply.session,
                    tokens=epb.TokenIds(ids=[65]),
                    config=epb.GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                ),
                metadata=OWNER,
            )
        )
        got = [t for e in events if e.HasField("tokens") for t in e.tokens.ids]
        engine.Close(epb.CloseRequest(session=reply.session), metadata=OWNER)
    assert got == in_process_tokens(p + [65], NEW_TOKENS)


def test_insert_names_its_engine(service, two_engines) -> None:
    engine = two_engines[1]
    p = prompts(1)[0]
    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        events = list(
            stub.Generate(
                epb.GenerateRequest(
                    tokens=epb.TokenIds(ids=p),
                    keep_session=True,
                    config=epb.GenerationConfig(max_new_tokens=1),
                ),
                metadata=OWNER,
            )
        )
        session, done = events[0].started.session, events[-1].done
        generated = [t for e in events if e.HasField("tokens") for t in e.tokens.ids]
        p = p + generated[: done.position - len(p)]  # what the session holds
        insert = prefix_pb2.InsertRequest(namespace="ns", tokens=p, session=session)
        with pytest.raises(grpc.RpcError) as missing:
            service.stub.Insert(insert, metadata=OWNER)
        assert (
            missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "engine" in missing.value.details()
        )
        insert.engine = "127.0.0.1:1"
        with pytest.raises(grpc.RpcError) as unknown:
            service.stub.Insert(insert, metadata=OWNER)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        insert.engine = engine.address
        assert service.stub.Insert(insert, metadata=OWNER).stored
        stub.Close(epb.CloseRequest(session=session), metadata=OWNER)
    _, done = service.generate(p + [66])
    assert done.engine == engine.address and done.reused_positions == len(p)


def test_an_engine_that_went_away_is_left_for_another_before_the_first_token(service, two_engines) -> None:
    p = prompts(1)[0]
    _, done = service.generate(p)
    holder = next(e for e in two_engines if e.address == done.engine)
    other = next(e for e in two_engines if e is not holder)
    holder.stop(0)  # the engine holding the prefix is gone; the service is not told
    tokens, done = service.generate(p + [67])  # no error for the client
    assert done.engine == other.address and done.reused_positions == 0
    assert tokens == in_process_tokens(p + [67], NEW_TOKENS)


def test_engines_join_through_the_pool_and_leave_when_they_drain(two_engines, engine_factory) -> None:
    a, b = two_engines
    svc = FleetService([a.address])
    try:
        assert [m.name for m in svc.fleet.members()] == [a.address]
        svc.generate(prompts(1)[0])
        assert a.deps.registry.usage("prefix-service").sessions == 1
        svc.targets = [a.address, b.address]
        svc.pool.sync()
        assert sorted(m.name for m in svc.fleet.members()) == sorted([a.address, b.address])
        _, done = svc.generate(prompts(2)[1])  # a miss: the emptier engine, which just joined
        assert done.engine == b.address
        svc.targets = [b.address]  # a's address went from the answer: that alone removes nothing
        svc.pool.sync()
        svc.pool.check_departures()
        assert sorted(m.name for m in svc.fleet.members()) == sorted([a.address, b.address])
        assert a.deps.registry.usage("prefix-service").sessions == 1
        a.deps.drain()  # what SIGTERM does first: Info says draining, health NOT_SERVING
        a.server.health_state.update(draining=True)
        assert wait_for(lambda: not a.server.health_state.serving)
        assert wait_for(
            lambda: (svc.pool.check_departures(), [m.name for m in svc.fleet.members()])[1] == [b.address]
        )
        assert wait_for(lambda: a.deps.registry.usage("prefix-service").sessions == 0)  # released on leaving
        assert svc.pool.stats().departures == {"draining": 1}
        _, done = svc.generate(prompts(1)[0] + [68])
        assert done.engine == b.address and done.reused_positions == 0
    finally:
        svc.stop()


def test_an_engine_of_another_model_is_held_out(engine_factory) -> None:
    same, odd, twin = engine_factory(), engine_factory(seed=1), engine_factory()
    odd.deps.fingerprint = "another-model"  # what Info reports (in-memory random models share one)
    svc = FleetService([odd.address, same.address, twin.address])  # the fingerprint most engines have wins
    try:
        for p in prompts(3):
            assert svc.generate(p)[1].engine != odd.address
        engines = {e.engine: e for e in svc.stub.Stats(prefix_pb2.StatsRequest()).engines}
        assert engines[same.address].routable and engines[twin.address].routable
        assert not engines[odd.address].routable and engines[odd.address].routed == 0
        assert engines[same.address].fingerprint != engines[odd.address].fingerprint
    finally:
        svc.stop()


def test_dns_targets_resolve_every_address() -> None:
    target = DnsTarget.parse("dns:///localhost:50051")
    assert "127.0.0.1:50051" in target.resolve()
    assert engine_targets(["127.0.0.1:1"], "dns:///localhost:7")() >= {"127.0.0.1:1", "127.0.0.1:7"}
    for bad in ("localhost:50051", "dns:///localhost", "dns:///localhost:0", "dns:///:80", "dns://a:0/b:1"):
        with pytest.raises(ValueError, match="engines"):
            DnsTarget.parse(bad)
    assert DnsTarget("no-such-host.invalid", 1).resolve() == set()
    assert DnsTarget.parse("dns://127.0.0.1:5353/engines.test:7") == DnsTarget(
        "engines.test", 7, ("127.0.0.1", 5353)
    )
    assert DnsTarget.parse("dns://[::1]/engines.test:7").server == ("::1", 53)
