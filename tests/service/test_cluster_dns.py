"""DNS as a cluster serves it, against a real prefix-service process (``--engines dns://SERVER/NAME``
asking a stub DNS server, ``dns_stub.py``) over a real engine: a resolver that fails for a while
costs nothing (the entries stay, lookups keep hitting; the failures are counted), while the engine's
own drain still empties them (the negative control: the test sees a departure when there is one);
an A and an AAAA record of one engine are one engine (the second address does not release the
first's snapshots: every lookup hits)."""

from __future__ import annotations

import socket
import time
import urllib.request

import grpc
import pytest

from protos import engine_pb2 as epb
from protos import engine_pb2_grpc, prefix_pb2, prefix_pb2_grpc
from tests.service.dns_stub import DnsStub
from tests.service.helpers import wait_for
from tests.service.test_engine_restart import ServiceProcess

NAME = "engines.forkline.test"
OWNER = (("forkline-owner", "client"),)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrefixProcess:
    """``python -m prefix_service --engines dns://...`` resolving every second (the pool's refresh), with metrics."""

    def __init__(self, engines: str) -> None:
        self.metrics_port = free_port()
        self.process = ServiceProcess(
            "prefix_service",
            *("--engines", engines, "--resolve_every", "0.2", "--port", "0"),
            *("--metrics_port", str(self.metrics_port), "--engine_leave_after", "30"),
            "--no-cache_generated",  # prompt snapshots only: the tests count them
        )
        self.channel = grpc.insecure_channel(self.process.listening())
        self.stub = prefix_pb2_grpc.PrefixCacheStub(self.channel)

    def generate(self, prompt: list[int]) -> epb.DoneEvent:
        request = prefix_pb2.GatewayGenerateRequest(
            tokens=epb.TokenIds(ids=prompt),
            config=epb.GenerationConfig(max_new_tokens=2, temperature=0.0, ignore_eos=True),
        )
        return list(self.stub.Generate(request, metadata=OWNER, timeout=30))[-1].done

    def lookup_reused(self, prompt: list[int], engine) -> int:
        """Positions a Lookup of ``prompt`` reuses (its clone closed again on the engine)."""
        reply = self.stub.Lookup(prefix_pb2.LookupRequest(tokens=epb.TokenIds(ids=prompt)), metadata=OWNER)
        if reply.session:
            with grpc.insecure_channel(engine.address) as channel:
                engine_pb2_grpc.EngineStub(channel).Close(
                    epb.CloseRequest(session=reply.session), metadata=OWNER
                )
        return reply.reused

    def stats(self) -> prefix_pb2.StatsResponse:
        return self.stub.Stats(prefix_pb2.StatsRequest(), timeout=10)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith(name + " ") or line.startswith(name + "{")
        )

    def stop(self) -> None:
        self.channel.close()
        self.process.kill()


def prompts(n: int) -> list[list[int]]:
    return [[ord(c) for c in f"{chr(65 + i)}: a system prompt the cluster keeps. "] for i in range(n)]


@pytest.fixture
def dns():
    stub = DnsStub()
    yield stub
    stub.close()


def test_a_failing_resolver_keeps_the_engines_and_their_entries(engine_factory, dns) -> None:
    engine = engine_factory(max_sessions=32)
    dns.records[NAME] = ["127.0.0.1"]
    service = PrefixProcess(dns.target(NAME, engine.port))
    try:
        for p in prompts(3):
            service.generate(p)
        assert service.stats().entries == 3
        dns.failing = True  # SERVFAIL for 2.5 s
        outage_end = time.monotonic() + 2.5
        while time.monotonic() < outage_end:
            for p in prompts(3):
                assert service.lookup_reused(p, engine) == len(p) - 1
            time.sleep(0.2)
        assert service.stats().entries == 3
        # the resolver kept asking (every 0.2 s) and failing, and the answer in use aged
        assert wait_for(lambda: service.metric("forkline_prefix_dns_failures_total") >= 2, timeout=60)
        assert wait_for(lambda: service.metric("forkline_prefix_dns_answer_age_seconds") >= 2.0, timeout=60)
        dns.failing, dns.records[NAME] = False, []  # the name answers, with nothing (NXDOMAIN)
        failures = service.metric("forkline_prefix_dns_failures_total")
        # two more failed resolutions: at least one asked after the switch got NXDOMAIN (an empty
        # answer counts as a failure and keeps the last addresses)
        assert wait_for(
            lambda: service.metric("forkline_prefix_dns_failures_total") >= failures + 2, timeout=60
        )
        assert service.stats().entries == 3 and len(service.stats().engines) == 1
        assert all(service.lookup_reused(p, engine) == len(p) - 1 for p in prompts(3))
        assert service.metric("forkline_prefix_dns_stale") == 0  # within --dns_stale_after

        # negative control: the engine's own drain is a departure, and the test sees it
        engine.deps.drain()
        engine.server.health_state.update(draining=True)
        assert wait_for(lambda: service.stats().entries == 0 and not service.stats().engines, timeout=15)
        assert service.metric("forkline_prefix_engine_departures_total") == 1
        assert wait_for(lambda: engine.deps.registry.usage("prefix-service").sessions == 0)
    finally:
        service.stop()


def test_an_a_and_an_aaaa_record_of_one_engine_are_one_engine(engine_factory, dns) -> None:
    engine = engine_factory(max_sessions=32, host="[::]")  # answers at 127.0.0.1 and at ::1
    dns.records[NAME] = ["127.0.0.1"]
    service = PrefixProcess(dns.target(NAME, engine.port))
    try:
        for p in prompts(6):
            service.generate(p)
        assert engine.deps.registry.usage("prefix-service").sessions == 6
        dns.records[NAME] = ["127.0.0.1", "::1"]  # the pod's AAAA record appears
        # the new address is opened and found to be the same engine
        assert wait_for(lambda: service.metric("forkline_prefix_engine_aliases_total") == 1, timeout=60)
        assert [service.lookup_reused(p, engine) for p in prompts(6)] == [len(p) - 1 for p in prompts(6)]
        assert engine.deps.registry.usage("prefix-service").sessions == 6
        assert service.stats().entries == 6 and len(service.stats().engines) == 1
        assert service.metric("forkline_prefix_engine_aliases_total") == 1
    finally:
        service.stop()
