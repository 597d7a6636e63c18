"""The trace half of bench_routing.py (``--trace-bench``, see its docstring): engine processes of the
packaged SmolLM2, one fleet per policy replaying the same trace, then the hot-prefix case."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

from routing_trace import (
    BLOCK_TOKENS,
    HEADER_BLOCKS,
    Recorded,
    hot_prefix_trace,
    make_trace,
    read_trace,
    replay,
    summary,
    warmup_trace,
    write_trace,
)

from prefix_service.engines.connect import connect_fleet
from prefix_service.fleet.routing import routing_policy
from prefix_service.tier.persistent_tier import PersistentTier

OUT = Path(__file__).resolve().parent / "out"
TRACE_POLICIES = ("cost", "cache_aware", "least_loaded", "round_robin")
HOT_POLICIES = ("cost", "cache_aware", "round_robin")
MAX_ENTRIES = 8  # per engine: the trace's working set fits in three engines' caches, not in one's
SNAPSHOT_DIR_BYTES = 4 << 30


def start_engine_processes(n: int) -> list:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.service.test_engine_restart import ServiceProcess, free_port, wait_serving

    class Engine(ServiceProcess):
        def __init__(self) -> None:
            self.port = free_port()
            super().__init__(
                "engine_service",
                "--port",
                str(self.port),
                "--max_sessions",
                "32",
                "--max_session_tokens",
                "1024",
            )

        @property
        def address(self) -> str:
            return f"127.0.0.1:{self.port}"

    # one kernel / BLAS thread each: three engines on a 2-core machine, not six threads fighting
    os.environ.update(FORKLINE_KERNEL_THREADS="1", OPENBLAS_NUM_THREADS="1")
    engines = [Engine() for _ in range(n)]
    for engine in engines:
        wait_serving(engine, timeout=120)
    return engines


def run(policy: str, addresses: list[str], trace, block_tokens: int, warmup=(), snapshot_dir: bool = True):
    """One fleet routed by ``policy`` replays ``warmup`` (not measured), then ``trace``: what each
    request got, the snapshots per engine at the end, the wall time and the rates it measured.
    ``snapshot_dir``: the fleet shares a fresh snapshot directory (deleted after)."""
    recorded = Recorded(routing_policy(policy))
    folder = tempfile.TemporaryDirectory(prefix="forkline-trace-") if snapshot_dir else None
    tier = None if folder is None else PersistentTier.open(folder.name, SNAPSHOT_DIR_BYTES)
    fleet, pool = connect_fleet(
        lambda: set(addresses), policy=recorded, max_entries=MAX_ENTRIES, resolve_every_s=60, tier=tier
    )
    try:
        if warmup:
            replay(fleet, recorded, list(warmup), block_tokens)
        served, wall = replay(fleet, recorded, trace, block_tokens)
        moves = sum(m.moves_in for m in fleet.members())
        return (
            served,
            {m.name: len(m.gateway) for m in fleet.members()},
            wall,
            (fleet.rates.rates(), moves),
        )
    finally:
        pool.stop()
        if tier is not None:
            tier.stop()  # its writer's last exports, while the engines' channels are open
        for member in fleet.members():
            fleet.remove(member.name)  # releases its snapshots in the engine
        if folder is not None:
            folder.cleanup()


def rounds(policies: tuple[str, ...], n: int, run_one, header: int = 0) -> dict:
    """Every policy ``n`` times, the order reversed every other round (the machine's other load
    drifts); each policy's figures over all its requests pooled (snapshots: the last round's)."""
    pooled: dict[str, list] = {p: [] for p in policies}
    walls: dict[str, float] = dict.fromkeys(policies, 0.0)
    last: dict[str, tuple] = {}
    moves: dict[str, int] = dict.fromkeys(policies, 0)
    for r in range(n):
        for policy in policies if r % 2 == 0 else policies[::-1]:
            served, entries, wall, (rates, moved) = run_one(policy)
            moves[policy] += moved
            pooled[policy] += served
            walls[policy] += wall
            last[policy] = (entries, rates)
            print(f"round {r} {policy}: {json.dumps(summary(served, entries, wall, header))}", flush=True)
    out = {}
    for policy in policies:
        entries, rates = last[policy]
        out[policy] = summary(pooled[policy], entries, walls[policy], header)
        out[policy]["served"] = [dataclasses.astuple(s) for s in pooled[policy]]  # the raw figures
        out[policy]["measured_rates"] = {
            "prefill_s_per_position": round(rates.prefill_s_per_position, 5),
            "queue_s_per_generation": round(rates.queue_s_per_generation, 4),
            "overhead_s": round(rates.overhead_s, 4),
            "move_overhead_s": round(rates.move_overhead_s, 4),
            "move_s_per_position": round(rates.move_s_per_position, 6),
        }
        out[policy]["moves"] = moves[policy]
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = [
        ("trace", "placement_regret_fraction", "placement regret / prompt positions"),
        ("trace", "reused_fraction", "reused / prompt positions"),
        ("trace", "ttft_p99_s", "TTFT p99 (s)"),
        ("trace", "load_imbalance", "busiest engine's prefill / mean"),
        ("hot_prefix", "ttft_p99_s", "hot prefix: TTFT p99 (s)"),
    ]
    fig, axes = plt.subplots(1, len(figures) + 1, figsize=(4 * (len(figures) + 1), 4))
    for ax, (part, key, label) in zip(axes, figures, strict=False):
        policies = list(results[part])
        ax.bar(
            policies, [results[part][p][key] for p in policies], color=[f"C{i}" for i in range(len(policies))]
        )
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax = axes[-1]
    for name, cost in results["decision_us_by_engines"].items():
        ax.plot([int(k) for k in cost], [v["p99"] for v in cost.values()], marker="o", label=name)
    ax.set_xlabel("engines")
    ax.set_title("decision p99 (us)", fontsize=9)
    ax.legend(fontsize=8)
    fig.suptitle(
        f"forkline routing: {results['trace_requests']} trace requests on {results['engines']} SmolLM2 engine processes",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def trace_bench(args: argparse.Namespace, decision_costs) -> None:
    OUT.mkdir(exist_ok=True)
    if args.trace is not None:
        trace, block_tokens = read_trace(args.trace, args.trace_limit), args.block_tokens
    else:
        trace, block_tokens = make_trace(), BLOCK_TOKENS
        if args.trace_limit:
            trace = trace[: args.trace_limit]
        write_trace(trace, OUT / "routing_trace.jsonl")
    if not args.rate > 0:
        raise SystemExit(f"--rate must be > 0, got {args.rate}")
    if args.rate != 1.0:  # the same requests, arriving args.rate times as fast
        trace = [dataclasses.replace(r, timestamp=int(r.timestamp / args.rate)) for r in trace]
    warmup, hot = hot_prefix_trace()
    with_dir = not args.no_snapshot_dir
    results: dict = {
        "engines": args.trace_engines,
        "trace_requests": len(trace),
        "trace_prompt_positions": sum(r.input_length for r in trace),
        "hot_prefix_requests": len(hot),
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "max_entries_per_engine": MAX_ENTRIES,
        "snapshot_dir": with_dir,
        "arrival_rate": args.rate,
        "trace": {},
        "hot_prefix": {},
    }
    engines = start_engine_processes(args.trace_engines)
    addresses = [e.address for e in engines]
    try:
        run("round_robin", addresses, warmup_trace(len(addresses)), BLOCK_TOKENS)
        header = 0 if args.trace is not None else HEADER_BLOCKS * BLOCK_TOKENS
        results["trace"] = rounds(
            tuple(args.policies or TRACE_POLICIES),
            args.rounds,
            lambda p: run(p, addresses, trace, block_tokens, snapshot_dir=with_dir),
            header,
        )
        # one unmeasured pass of the hot-prefix case over every engine first: whichever policy ran
        # the first measured pass paid for the engines' first prompts of that shape (its p99 1.2-1.3 s
        # against 0.3-0.5 s in the passes after, for cache_aware as for cost)
        run("round_robin", addresses, hot, BLOCK_TOKENS, warmup, snapshot_dir=with_dir)
        results["hot_prefix"] = rounds(
            tuple(args.hot_policies or HOT_POLICIES),
            args.rounds,
            lambda p: run(p, addresses, hot, BLOCK_TOKENS, warmup, snapshot_dir=with_dir),
        )
    finally:
        for engine in engines:
            engine.kill()
    results["decision_entries"] = args.decision_entries
    results["decision_us_by_engines"] = decision_costs()
    print(json.dumps(results, indent=2))
    (OUT / "bench_routing_trace.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / "bench_routing_trace.png")
