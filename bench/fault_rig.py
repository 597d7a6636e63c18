"""The fault campaign's rig (``bench/faults.py``): the tests' tiny engine in its own process (forwards
slowed), engines on fixed ports behind a prefix service, a cold reference run, a stream read with a
fault hook."""

from __future__ import annotations

import os
import random
import threading
import time

from bench_resume import free_port
from workload_servers import Process

from clients.engine_client import EngineClient
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.stream_events import Done, Tokens
from protos import prefix_pb2

STEP_S = 0.02


def tiny_engine(port: int, role: str = "both", kv_dtype: str = "auto", host: str = "127.0.0.1") -> Process:
    os.environ["FORKLINE_TEST_STEP_S"] = str(STEP_S)
    flags = ["--port", str(port), "--role", role, "--kv_dtype", kv_dtype, "--host", host]
    return Process(["tests.service.tiny_engine", *flags], ["grpc"])


class Rig:
    """Tiny engines on fixed ports and a prefix service over them (optionally a snapshot directory)."""

    def __init__(self, engines: int, folder: str | None = None, roles: tuple[str, ...] = ()) -> None:
        self.ports = [free_port() for _ in range(engines)]
        self.roles = dict(zip(self.ports, roles or ("both",) * engines, strict=True))
        self.engines = {p: tiny_engine(p, self.roles[p]) for p in self.ports}
        self.folder = folder
        self.prefix_port = free_port()
        self.prefix = self._prefix()

    def _prefix(self) -> Process:
        addresses = [a for p in self.ports for a in ("--engine", f"127.0.0.1:{p}")]
        # with a directory: prompt snapshots only, so the file a trial damages is the one it asks for
        extra = ["--snapshot_dir", self.folder, "--no-cache_generated"] if self.folder else []
        return Process(["prefix_service", *addresses, "--port", str(self.prefix_port), *extra], ["grpc"])

    def client(self) -> PrefixClient:
        return PrefixClient(f"127.0.0.1:{self.prefix_port}", owner="faults", timeout=120)

    def serving(self, client: PrefixClient) -> int:
        stats = client.stub.Stats(prefix_pb2.StatsRequest(), timeout=30).engines
        return int(next(e.engine for e in stats if e.in_flight > 0).rsplit(":", 1)[1])

    def restart_engine(self, port: int) -> None:
        for attempt in range(5):
            try:
                self.engines[port] = tiny_engine(port, self.roles[port])
                return
            except RuntimeError:
                if attempt == 4:
                    raise
                time.sleep(1)

    def routable(self, client: PrefixClient, count: int) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = client.stub.Stats(prefix_pb2.StatsRequest(), timeout=30).engines
            if sum(e.routable for e in stats) == count:
                return
            time.sleep(0.1)
        raise RuntimeError("engines did not become routable")

    def stop(self) -> None:
        for process in [self.prefix, *self.engines.values()]:
            process.stop()


def random_prompt(rng: random.Random) -> list[int]:
    """80-199 capital letters: a prompt no earlier trial stored."""
    return [rng.randrange(65, 91) for _ in range(rng.randrange(80, 200))]


def cold(port: int, prompt: list[int], config: GenConfig) -> list[int]:
    client = EngineClient(f"127.0.0.1:{port}", owner="cold", timeout=120)
    try:
        return list(client.generate(prompt, config=config, ignore_eos=True).collect().tokens)
    finally:
        client.close_channel()


class Ledger:
    """Every id sequence the campaign's streams computed (prompt, then prompt + tokens streamed), and
    the check that a stream's reused positions never exceed the longest prefix that any other stream
    (earlier or concurrent: an in-flight prefill may be joined) shares with its prompt."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seen: list[tuple[int, ...]] = []
        self.checked = self.reused = 0  # streams checked, the positions they reported reused
        self.over: list[dict] = []

    def begin(self, prompt: list[int]) -> int:
        with self._lock:
            self.seen.append(tuple(prompt))
            return len(self.seen) - 1

    def end(self, index: int, prompt: list[int], tokens: list[int], done: Done | None) -> None:
        with self._lock:
            self.seen[index] = (*prompt, *tokens)
            if done is None:
                return
            bound = max((_common(prompt, ids) for i, ids in enumerate(self.seen) if i != index), default=0)
            self.checked += 1
            self.reused += done.reused_positions
            if done.reused_positions > bound:
                self.over.append({"reused": done.reused_positions, "bound": bound})

    def take(self) -> tuple[int, int, list[dict]]:
        """(streams checked, positions they reported reused, those over the bound) since the last
        take; the sequences are forgotten."""
        with self._lock:
            taken = self.checked, self.reused, self.over
            self.seen, self.checked, self.reused, self.over = [], 0, 0, []
        return taken


def _common(a: list[int], b: tuple[int, ...]) -> int:
    """Shared leading tokens, counted here rather than by the cache's own ``common_prefix``: the
    ledger is the campaign's independent reference."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


LEDGER = Ledger()


def streamed(client: PrefixClient, prompt: list[int], config: GenConfig, at_event) -> tuple[list[int], Done]:
    """The stream's tokens and Done, its reused count checked by ``LEDGER``; ``at_event(event,
    tokens)`` is called on each event. A stream that fails is still recorded (what it streamed)."""
    index = LEDGER.begin(prompt)
    tokens: list[int] = []
    done = None
    try:
        for event in client.generate(prompt, config=config, ignore_eos=True, namespace="faults"):
            if isinstance(event, Tokens):
                tokens.extend(event.ids)
            if isinstance(event, Done):
                done = event
            at_event(event, tokens)
    finally:
        LEDGER.end(index, prompt, tokens, done)
    assert done is not None
    return tokens, done


def plot(report: dict, path: str) -> None:
    """The campaign's chart: trials and outputs equal to the cold run, per class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["classes"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [report["classes"][n]["trials"] for n in names], label="trials", color="lightgray")
    ax.bar(names, [report["classes"][n]["exact"] for n in names], 0.5, label="equal to the cold run")
    ax.set_ylabel("trials")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
