"""A replayable routing trace and its replay through one fleet (``bench_routing.py --trace-bench``).

Trace format: the Mooncake trace's (one JSON object per line: ``timestamp`` in ms from the start,
``input_length`` and ``output_length`` in tokens, ``hash_ids``: the prompt's blocks, each
``BLOCK_TOKENS`` tokens, equal ids meaning equal blocks; this trace's blocks are 8 tokens), so a recorded Mooncake trace replays too
(``--trace FILE --block-tokens 512``). A block's tokens are drawn from a generator seeded with its id,
so the trace alone fixes every prompt; prompt = the blocks' tokens cut to ``input_length``.

:func:`make_trace` writes this project's trace (seeded, so it is the same on every run):

- every prompt begins with the same 4-block header (a chat template's and a platform's preamble);
- tenants of different sizes: 5 system prompts of 6-14 blocks, drawing 35/20/10/5/5 % of requests;
  each tenant request is a chat of 1-3 turns: a turn's prompt is the previous turn's prompt + one
  answer block + two new user blocks, sent ``think_ms`` after the previous turn;
- a hot shared prefix: 15 % of requests are one 12-block prefix (a popular document) + 2 own blocks;
- a long tail: 10 % are one-off prompts of 6-16 unique blocks;
- arrivals: Poisson at ``rate`` conversations / requests per second.

:func:`hot_prefix_trace` is the hot-prefix case alone: every request one long shared prefix + 2 own
blocks, stored on one engine by a warm-up request, then arriving in a burst (where SGLang #21199 saw cache-aware routing's p99 TTFT at 2.6x round
robin's: every request piles on the one engine that holds the prefix).
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from engine_service.api.config import GenConfig
from engine_service.api.stream_events import Done, Tokens
from prefix_service.fleet.fleet import Fleet
from prefix_service.fleet.routing import Candidate, Route, RouteRequest, RoutingPolicy

BLOCK_TOKENS = 8
TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary ids of SmolLM2 (no special tokens)
NAMESPACE = "trace"
HEADER_BLOCKS = 4


@dataclass(frozen=True)
class TraceRequest:
    timestamp: int  # ms
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def tokens(self, block_tokens: int = BLOCK_TOKENS) -> list[int]:
        out: list[int] = []
        for h in self.hash_ids:
            rng = random.Random(h)
            out += [rng.randrange(*TOKEN_RANGE) for _ in range(block_tokens)]
        return out[: self.input_length]


def write_trace(trace: Iterable[TraceRequest], path: Path) -> None:
    lines = [
        json.dumps(
            {
                "timestamp": r.timestamp,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
        )
        for r in trace
    ]
    path.write_text("\n".join(lines) + "\n")


def read_trace(path: Path, limit: int = 0) -> list[TraceRequest]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(
                TraceRequest(d["timestamp"], d["input_length"], d["output_length"], tuple(d["hash_ids"]))
            )
    out.sort(key=lambda r: r.timestamp)
    return out[:limit] if limit else out


class _Blocks:
    """Fresh block ids."""

    def __init__(self) -> None:
        self._next = 0

    def take(self, n: int) -> list[int]:
        ids = list(range(self._next, self._next + n))
        self._next += n
        return ids


def _request(at_ms: float, blocks: list[int], output: int) -> TraceRequest:
    return TraceRequest(int(at_ms), len(blocks) * BLOCK_TOKENS, output, tuple(blocks))


def make_trace(
    conversations: int = 32, rate: float = 1.0, think_ms: float = 2500, output: int = 4, seed: int = 0
) -> list[TraceRequest]:
    """See the module docstring: ``conversations`` arrivals (tenant chats, hot-prefix and tail requests)."""
    rng = random.Random(seed)
    blocks = _Blocks()
    header = blocks.take(HEADER_BLOCKS)
    systems = [header + blocks.take(n) for n in (12, 8, 10, 6, 14)]
    weights = [0.35, 0.20, 0.10, 0.05, 0.05]
    hot = header + blocks.take(12)
    out: list[TraceRequest] = []
    now = 0.0
    for _ in range(conversations):
        now += rng.expovariate(rate) * 1000
        kind = rng.random()
        if kind < sum(weights):
            tenant = rng.choices(range(len(systems)), weights)[0]
            prompt = systems[tenant] + blocks.take(2)
            at = now
            for turn in range(rng.choice((1, 2, 3))):
                if turn:
                    prompt = prompt + blocks.take(3)  # the answer, then the next question
                    at += think_ms
                out.append(_request(at, prompt, output))
        elif kind < sum(weights) + 0.15:
            out.append(_request(now, hot + blocks.take(2), output))
        else:
            out.append(_request(now, header + blocks.take(rng.randrange(6, 17)), output))
    out.sort(key=lambda r: r.timestamp)
    return out


def hot_prefix_trace(
    requests: int = 16, prefix_blocks: int = 32, gap_ms: float = 100, output: int = 4
) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """(warm-up, burst): one request that stores the prefix on one engine, then the burst."""
    blocks = _Blocks()
    hot = blocks.take(prefix_blocks)
    warmup = [_request(0, hot + blocks.take(2), output)]
    return warmup, [_request(i * gap_ms, hot + blocks.take(2), output) for i in range(requests)]


def warmup_trace(engines: int, output: int = 4) -> list[TraceRequest]:
    """Unrelated prompts of a few lengths, a few per engine, one at a time (fresh engine processes
    compile their kernels' shapes on their first requests: no policy should pay for that)."""
    blocks = _Blocks()
    blocks.take(1_000_000)  # ids no trace above uses
    return [_request(i * 1500, blocks.take(n), output) for i in range(engines) for n in (4, 16, 40)]


class Recorded:
    """A routing policy that remembers, per calling thread, the longest reuse any engine or source
    (a draining engine, the snapshot directory) offered."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy, self.name = policy, policy.name
        self.local = threading.local()

    def route(self, candidates: list[Candidate], request: RouteRequest | None = None) -> Route:
        sources = () if request is None else request.sources
        self.local.best = max(c.reusable for c in (*candidates, *sources))
        return self.policy.route(candidates, request)


@dataclass(frozen=True)
class Served:
    engine: str
    prompt: int
    reused: int
    reusable_anywhere: int
    ttft_s: float


def replay(fleet: Fleet, recorded: Recorded, trace: list[TraceRequest], block_tokens: int, workers: int = 32):
    """Send every request at its timestamp (from its own thread); returns what each got."""
    served: list[Served] = []
    lock = threading.Lock()

    def one(i: int, r: TraceRequest) -> None:
        from engine_service.api.call_context import CallContext
        from prefix_service.gateway.calls import GatewayRequest

        tokens = r.tokens(block_tokens)
        config = GenConfig(max_new_tokens=max(1, r.output_length))
        start = time.perf_counter()
        first = 0.0
        done = None
        for event in fleet.generate(
            GatewayRequest(NAMESPACE, tokens, config, ignore_eos=True), CallContext(f"client-{i}")
        ):
            if isinstance(event, Tokens) and not first:
                first = time.perf_counter() - start
            if isinstance(event, Done):
                done = event
        assert done is not None
        with lock:
            served.append(Served(done.engine, len(tokens), done.reused_positions, recorded.local.best, first))

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        futures = []
        for i, r in enumerate(trace):
            delay = start + r.timestamp / 1000 - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, i, r))
        for f in futures:
            f.result()
    return served, time.perf_counter() - start


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(served: list[Served], entries: dict[str, int], wall_s: float, header: int = 0) -> dict:
    """The figures the bench compares policies on (see bench_routing.py's docstring); a hit reuses
    more than the ``header`` positions every prompt of the trace begins with."""
    prompt = sum(s.prompt for s in served)
    reused = sum(s.reused for s in served)
    regret = sum(max(0, s.reusable_anywhere - s.reused) for s in served)
    work: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    for name in entries:
        work[name] = 0
        requests[name] = 0
    for s in served:
        work[s.engine] += s.prompt - s.reused
        requests[s.engine] += 1
    ttft = [s.ttft_s for s in served]
    mean_work = statistics.mean(work.values())
    return {
        "requests": len(served),
        "placement_regret_positions": regret,
        "placement_regret_fraction": round(regret / prompt, 4),
        "reused_fraction": round(reused / prompt, 4),
        "hit_rate": round(sum(s.reused > header for s in served) / len(served), 4),
        "ttft_p50_s": round(_percentile(ttft, 0.5), 3),
        "ttft_p99_s": round(_percentile(ttft, 0.99), 3),
        "load_imbalance": round(max(work.values()) / mean_work, 3) if mean_work else 1.0,
        "computed_positions_per_engine": sorted(work.values(), reverse=True),
        "requests_per_engine": sorted(requests.values(), reverse=True),
        "snapshots_per_engine": sorted(entries.values(), reverse=True),
        "wall_s": round(wall_s, 1),
    }
