"""The fault campaign's ``dns_gone`` class (``bench/faults.py``): two tiny engines on one port at
127.0.0.1 and 127.0.0.2, found by the prefix service through a stub DNS server
(``--engines dns://STUB/NAME:PORT``, ``tests/service/dns_stub.py``). At a random token of a stream the
answer for the engine serving it goes away: its record is removed (a pod deleted, its engine still up),
the server fails (SERVFAIL for the rest of the stream), or the record is removed and the engine killed
(a pod gone for good). Every stream must equal the cold run; the answer is restored after each trial."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from bench_resume import free_port
from fault_rig import cold, random_prompt, streamed, tiny_engine
from workload_servers import Process

from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from protos import prefix_pb2
from tests.service.dns_stub import DnsStub

NAME = "engines.faults.test"
HOSTS = ("127.0.0.1", "127.0.0.2")
MODES = ("record_removed", "servfail", "record_removed_and_killed")


class DnsRig:
    """Two engines behind one DNS name, a prefix service resolving it every 0.2 s."""

    def __init__(self) -> None:
        self.port = free_port()
        self.engines = {host: tiny_engine(self.port, host=host) for host in HOSTS}
        self.dns = DnsStub()
        self.answer()
        self.prefix_port = free_port()
        target = self.dns.target(NAME, self.port)
        flags = ["--engines", target, "--resolve_every", "0.2", "--port", str(self.prefix_port)]
        self.prefix = Process(["prefix_service", *flags], ["grpc"])

    def answer(self) -> None:
        """The whole answer again: both engines, no failure."""
        self.dns.failing = False
        self.dns.records[NAME] = list(HOSTS)

    def client(self) -> PrefixClient:
        return PrefixClient(f"127.0.0.1:{self.prefix_port}", owner="faults", timeout=120)

    def routable(self, client: PrefixClient) -> int:
        stats = client.stub.Stats(prefix_pb2.StatsRequest(), timeout=30).engines
        return sum(e.routable for e in stats)

    def serving(self, client: PrefixClient) -> str:
        stats = client.stub.Stats(prefix_pb2.StatsRequest(), timeout=30).engines
        return next(e.engine for e in stats if e.in_flight > 0).rsplit(":", 1)[0]

    def stop(self) -> None:
        for process in [self.prefix, *self.engines.values()]:
            process.stop()
        self.dns.close()


def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("engines did not become routable")
        time.sleep(0.1)


def dns_gone(trials: int, rng: random.Random, new_tokens: int) -> list[dict]:
    rig = DnsRig()
    rows = []
    try:
        client = rig.client()
        wait_until(lambda: rig.routable(client) == 2, 60)
        for trial in range(trials):
            prompt = random_prompt(rng)
            config = GenConfig(max_new_tokens=new_tokens, temperature=rng.choice([0.0, 1.0]), seed=trial)
            reference = cold(rig.port, prompt, config)
            point, mode = rng.randrange(1, new_tokens - 5), rng.choice(MODES)
            fired: list[str] = []

            def fault(event, tokens, point=point, mode=mode, fired=fired) -> None:
                if fired or len(tokens) < point:
                    return
                host = rig.serving(client)
                fired.append(host)
                if mode == "servfail":
                    rig.dns.failing = True
                    return
                rig.dns.records[NAME] = [h for h in HOSTS if h != host]
                if mode == "record_removed_and_killed":
                    rig.engines[host].proc.kill()

            tokens, done = streamed(client, prompt, config, fault)
            rows.append({"exact": tokens == reference, "mode": mode, "resumes": done.resumes,
                         "ended": f"{mode}:{'resumed' if done.resumes else 'uninterrupted'}"})  # fmt: skip
            if mode == "record_removed_and_killed":
                rig.engines[fired[0]] = tiny_engine(rig.port, host=fired[0])
            rig.answer()
            wait_until(lambda: rig.routable(client) == 2, 60)
        client.close_channel()
    finally:
        rig.stop()
    return rows
