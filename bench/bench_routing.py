"""Routing benchmark: what cache-aware routing over several engines buys, and what one prefix service
can route per second. Real engine and prefix servers on 127.0.0.1 (tiny seeded model: routing and
reuse do not depend on the model's size; the engines share this machine's cores).

1. Policies: --engines engines behind one prefix service per policy (cache_aware, least_loaded,
   round_robin), the same workload through each: --system-prompts shared system prompts of
   --system-tokens tokens, each followed by a unique user turn, --requests gateway generations from
   --clients concurrent clients. Reported per policy: prompt positions reused / prompt positions
   (what the engines did not recompute), lookup hit rate, entries stored, requests per engine, wall
   time (and wall x clients / requests: a request's mean latency).
2. Routing throughput: concurrent gRPC Lookups (misses: tokenize-free token ids, one route, one engine
   Info and one cache walk each; and hits: plus the clone for the caller and its Close) through one
   prefix service over the engines, at --clients and 4x --clients client threads; and the in-process
   cost of one routing decision (scoring every engine's index + the policy) with 2..16 engines.

3. Decision cost: microseconds per routing decision (every engine's index scored + the policy), p50 and
   p99 over --decision-repeats decisions, per policy, at 2..16 engines.

Prints one JSON object, writes bench/out/bench_routing.json and bench/out/bench_routing.png.
Usage: .venv/bin/python bench/bench_routing.py [--engines 4] [--requests 240] [--clients 8]

--trace-bench instead replays ``routing_trace.py``'s trace (or --trace FILE, Mooncake format) on
--trace-engines engine processes of the packaged SmolLM2 (one kernel thread each) through one fleet
per policy, then the hot-prefix case (after one unmeasured pass of it), and measures the decision
cost; compared per policy: placement
regret (positions some engine could have reused at routing time minus positions reused, over all
requests), reused fraction, hit rate (requests that reused anything), TTFT p50 / p99 (from the
fleet's generate call to the first tokens), load imbalance (the busiest engine's computed positions
over the mean) and snapshots per engine at the end. Each fleet shares a fresh snapshot directory
(``--snapshot_dir``, as deployed; ``--no-snapshot-dir``: none), which is also a move source. Writes
bench/out/bench_routing_trace.json / .png and the trace it replayed (bench/out/routing_trace.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

import engine_service  # noqa: F401  (OpenBLAS before mlx)
from engine_service.executors.options import ExecutorSettings
from engine_service.model.random_init import random_model
from engine_service.model.text.chat import ChatFormatter
from engine_service.rpc.server import create_server as create_engine_server
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED
from prefix_service.engines.connect import connect_fleet
from prefix_service.fleet.rates import CostRates
from prefix_service.fleet.routing import Candidate, RouteRequest, routing_names, routing_policy
from prefix_service.rpc.server import create_server
from protos import engine_pb2 as epb
from protos import engine_pb2_grpc, prefix_pb2, prefix_pb2_grpc

OUT = Path(__file__).resolve().parent / "out"
OWNER = (("forkline-owner", "bench"),)


def start_engines(n: int) -> list:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tiny-model tokenizer
    from tests.service.conftest import char_tokenizer

    engines = []
    for _ in range(n):
        deps = EngineSessions.build(
            random_model("FRFR", 4, 0),
            char_tokenizer(),
            model_name="tiny-FRFR-seed0",
            chat=ChatFormatter(name="chatml"),
            executor=ExecutorSettings(max_sessions=64, max_session_tokens=1024, prefill_chunk=128),
            sessions=UNLIMITED,
        )
        engines.append(create_engine_server(deps, "127.0.0.1:0"))  # (server, port)
    return engines


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    systems = [
        [rng.randrange(32, 127) for _ in range(args.system_tokens)] for _ in range(args.system_prompts)
    ]
    return [
        systems[rng.randrange(len(systems))] + [rng.randrange(32, 127) for _ in range(args.user_tokens)]
        for _ in range(args.requests)
    ]


def run_policy(policy: str, addresses: list[str], prompts: list[list[int]], clients: int) -> dict:
    fleet, pool = connect_fleet(
        lambda: set(addresses),
        policy=routing_policy(policy),
        max_entries=256,
        engine_share=1.0,
        resolve_every_s=60,
    )
    server, port = create_server(fleet, "127.0.0.1:0", pool=pool)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = prefix_pb2_grpc.PrefixCacheStub(channel)
    served: Counter[str] = Counter()
    reused = total = 0
    lock = threading.Lock()

    def one(prompt: list[int]) -> None:
        nonlocal reused, total
        request = prefix_pb2.GatewayGenerateRequest(
            tokens=epb.TokenIds(ids=prompt),
            config=epb.GenerationConfig(max_new_tokens=2, temperature=0.0, ignore_eos=True),
        )
        done = list(stub.Generate(request, metadata=OWNER, timeout=120))[-1].done
        with lock:
            served[done.engine] += 1
            reused += done.reused_positions
            total += done.reused_positions + done.prompt_positions

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool_:
        list(pool_.map(one, prompts))
    wall = time.perf_counter() - start
    stats = stub.Stats(prefix_pb2.StatsRequest())
    channel.close()
    server.stop(0)  # releases its snapshots in the engines
    return {
        "reused_fraction": round(reused / total, 4),
        "hit_rate": round(stats.hits / max(1, stats.hits + stats.misses), 4),
        "entries": stats.entries,
        "requests_per_engine": sorted(served.values(), reverse=True),
        "wall_s": round(wall, 2),
    }


def lookup_throughput(addresses: list[str], threads: int, seconds: float, hits: bool) -> float:
    fleet, pool = connect_fleet(lambda: set(addresses), max_entries=256, engine_share=1.0, resolve_every_s=60)
    server, port = create_server(fleet, "127.0.0.1:0", pool=pool)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = prefix_pb2_grpc.PrefixCacheStub(channel)
    prompt = [ord(c) for c in "a stored system prompt for the lookup benchmark, long enough to matter. "] * 4
    if hits:
        list(
            stub.Generate(
                prefix_pb2.GatewayGenerateRequest(
                    tokens=epb.TokenIds(ids=prompt),
                    config=epb.GenerationConfig(max_new_tokens=1, ignore_eos=True),
                ),
                metadata=OWNER,
            )
        )
    engine_channels = {a: grpc.insecure_channel(a) for a in addresses}
    engine_stubs = {a: engine_pb2_grpc.EngineStub(c) for a, c in engine_channels.items()}
    stop = time.perf_counter() + seconds
    counts = [0] * threads

    def worker(i: int) -> None:
        rng = random.Random(i)
        while time.perf_counter() < stop:
            ids = prompt + [65] if hits else [rng.randrange(32, 127) for _ in range(64)]
            reply = stub.Lookup(prefix_pb2.LookupRequest(tokens=epb.TokenIds(ids=ids)), metadata=OWNER)
            if reply.session:
                engine_stubs[reply.engine].Close(epb.CloseRequest(session=reply.session), metadata=OWNER)
            counts[i] += 1

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    rate = sum(counts) / (time.perf_counter() - start)
    for c in engine_channels.values():
        c.close()
    channel.close()
    server.stop(0)
    return round(rate, 1)


def decision_cost(
    engine_counts: list[int], entries: int, repeats: int = 2000, policy_name: str = "cost"
) -> dict:
    """Microseconds per routing decision, {engines: {"p50", "p99", "cpu_p50", "cpu_p99"}}: each
    engine's index scored for the prompt (a real PrefixCache walk over ``entries`` stored keys) + the
    policy, as the fleet does it (``Fleet._route`` without the tokenization); wall time and the
    thread's CPU time (on a shared machine the wall p99 includes waiting for a core)."""
    from engine_service.api.content import content_digest
    from prefix_service.cache.index import token_key
    from prefix_service.cache.prefix_cache import PrefixCache

    class Handles:  # a backend whose handles are ints: inserts need only position / validity / digest
        fingerprint = "bench"

        def __init__(self) -> None:
            self.tokens: dict[int, tuple[int, ...]] = {}

        def clone(self, handle, upto):
            return None

        def close(self, handle) -> None:
            self.tokens.pop(handle, None)

        def position(self, handle) -> int:
            return len(self.tokens[handle])

        def valid(self, handle) -> bool:
            return handle in self.tokens

        def content_digest(self, handle):
            return content_digest(self.tokens[handle])

    rng = random.Random(1)
    out = {}
    policy = routing_policy(policy_name)
    rates = CostRates()
    for n in engine_counts:
        caches = []
        for _ in range(n):
            backend = Handles()
            cache = PrefixCache(backend, max_entries=entries + 1)
            for h in range(entries):
                key = tuple(rng.randrange(0, 50_000) for _ in range(512))
                backend.tokens[h] = key
                cache.insert("ns", key, h)
            caches.append((cache, key))
        prompt = list(caches[0][1]) + [7] * 64  # a hit on the first engine's last key
        times, cpu = [], []
        for i in range(repeats):
            start, start_cpu = time.perf_counter(), time.thread_time()
            key = token_key(prompt)  # as the fleet does: validated once, scored on every engine
            candidates = [
                Candidate(
                    str(e), cache.reusable("ns", key), i % 3, cache.positions, len(cache) / cache.max_entries
                )
                for e, (cache, _) in enumerate(caches)
            ]
            policy.route(candidates, RouteRequest(len(prompt), rates))
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
        times.sort()
        cpu.sort()
        at = {"p50": min(repeats - 1, repeats // 2), "p99": min(repeats - 1, int(0.99 * repeats))}
        out[n] = {q: round(times[i] * 1e6, 1) for q, i in at.items()}
        out[n].update({f"cpu_{q}": round(cpu[i] * 1e6, 1) for q, i in at.items()})
    return out


def decision_costs(args: argparse.Namespace) -> dict:
    return {
        name: decision_cost([2, 4, 8, 16], args.decision_entries, args.decision_repeats, name)
        for name in ("cost", "cache_aware")
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    policies = list(results["policies"])
    ax = axes[0]
    ax.bar(policies, [results["policies"][p]["reused_fraction"] for p in policies], color=["C0", "C1", "C2"])
    ax.set_ylabel("prompt positions reused / prompt positions")
    ax.set_title(f"{results['engines']} engines, {results['system_prompts']} shared system prompts")
    ax = axes[1]
    ax.bar(policies, [results["median_request_s"][p] for p in policies], color=["C0", "C1", "C2"])
    ax.set_ylabel("seconds per request (wall x clients / requests)")
    ax.set_title(f"{results['requests']} requests from {results['clients']} clients")
    ax = axes[2]
    for name, cost in results["decision_us_by_engines"].items():
        ax.plot([int(k) for k in cost], [v["p99"] for v in cost.values()], marker="o", label=f"{name} p99")
    ax.legend()
    ax.set_xlabel("engines")
    ax.set_ylabel("us per routing decision (p99)")
    ax.set_title(f"routing decision, {results['decision_entries']} entries per engine")
    ax.grid(alpha=0.3)
    fig.suptitle(
        f"forkline routing: Lookups/s through one prefix service: {results['lookups_per_s']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--system-prompts", type=int, default=12)
    p.add_argument("--system-tokens", type=int, default=384)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--seconds", type=float, default=5.0, help="per Lookup-throughput measurement")
    p.add_argument("--decision-entries", type=int, default=256)
    p.add_argument("--decision-repeats", type=int, default=2000)
    p.add_argument("--trace-bench", action="store_true", help="the trace bench (see the docstring) instead")
    p.add_argument("--trace", type=Path, default=None, help="a trace file to replay (Mooncake format)")
    p.add_argument("--block-tokens", type=int, default=8, help="tokens per hash id of --trace")
    p.add_argument("--trace-engines", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="trace bench: runs of each policy, pooled")
    p.add_argument(
        "--policies", nargs="+", default=None, help="trace bench: the policies of the trace (default: all)"
    )
    p.add_argument(
        "--hot-policies", nargs="+", default=None, help="trace bench: those of the hot-prefix case"
    )
    p.add_argument("--trace-limit", type=int, default=0, help="replay only the first N requests")
    p.add_argument(
        "--rate", type=float, default=1.0, help="trace bench: arrival-rate multiplier (2: timestamps halved)"
    )
    p.add_argument(
        "--no-snapshot-dir",
        action="store_true",
        help="trace bench: fleets without a snapshot directory (default: each fleet gets a fresh one, "
        "as the Kubernetes deployment's --snapshot_dir)",
    )
    args = p.parse_args()
    if args.trace_bench:
        from routing_trace_bench import trace_bench

        trace_bench(args, lambda: decision_costs(args))
        return

    engines = start_engines(args.engines)
    addresses = [f"127.0.0.1:{port}" for _, port in engines]
    results: dict = {
        "engines": args.engines,
        "requests": args.requests,
        "clients": args.clients,
        "system_prompts": args.system_prompts,
        "system_tokens": args.system_tokens,
        "user_tokens": args.user_tokens,
        "cpus": os.cpu_count(),
        "policies": {},
    }
    try:
        prompts = workload(args)
        for policy in routing_names():
            results["policies"][policy] = run_policy(policy, addresses, prompts, args.clients)
        results["lookups_per_s"] = {
            f"{kind}_{threads}_threads": lookup_throughput(addresses, threads, args.seconds, kind == "hits")
            for kind in ("misses", "hits")
            for threads in (args.clients, 4 * args.clients)
        }
    finally:
        for engine, _ in engines:
            engine.stop(0, shutdown_runner=True)
    results["decision_entries"] = args.decision_entries
    results["decision_us_by_engines"] = decision_costs(args)
    cache_aware = results["policies"]["cache_aware"]["reused_fraction"]
    results["reuse_cache_aware_over_round_robin"] = round(
        cache_aware / max(1e-9, results["policies"]["round_robin"]["reused_fraction"]), 3
    )
    results["median_request_s"] = {
        k: round(v["wall_s"] / args.requests * args.clients, 4) for k, v in results["policies"].items()
    }
    print(json.dumps(results, indent=2))
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_routing.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / "bench_routing.png")


if __name__ == "__main__":
    main()
