"""Prefix cache: time to first token cold vs after a hit, and lookup latency at 10,000 entries.

1. Real model (packaged SmolLM2-135M, float32 weights on the CPU), in-process Runner + ModuleExecutor
   + PrefixCache over RunnerBackend, both cache kinds. For prompts of 256, 1024 and 2048 tokens:
   cold = a fresh session prefilling the whole request (prompt + suffix); hit = ``lookup`` (the clone)
   + prefill of the 1..16-token suffix left after the hit. Both timed from the caller (before the
   lookup / generate call) to the first token's callback. Target: hit / cold < 1/50 at 1024 tokens.
2. Lookup latency with a fake backend (clone is free), so it measures the cache and its token index:
   10,000 stored entries of 2,000 tokens (100 shared 1,000-token system prompts x 100 continuations).
   Requests (lists, as a caller sends them): an exact stored key, a stored system prompt + a new
   continuation, a request diverging inside a system prompt (100 equal-length candidates), a miss.
   Target: p99 < 1 ms.

Prints JSON, writes bench/out/bench_prefix.json and bench/out/bench_prefix.png.

Usage: .venv/bin/python bench/bench_prefix.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

import engine_service  # noqa: F401  (OpenBLAS before mlx)
from clients.runner_backend import RunnerBackend
from engine_service.api.config import GenConfig
from engine_service.api.content import content_digest
from engine_service.executors.module import ModuleExecutor
from engine_service.runtime.runner import Runner
from prefix_service.cache.prefix_cache import PrefixCache

OUT = Path(__file__).resolve().parent / "out"
NS = "bench"
SUFFIXES = (1, 4, 16)


# --------------------------------------------------------------------------- time to first token


def timed_first_token(session, tokens, started: tuple[float, float]) -> tuple[float, float]:
    """(wall s, process CPU s) from ``started`` = (perf_counter, process_time) to the first token's
    callback of a 1-token generation on ``session``. CPU time counts every thread of this process
    (engine thread, BLAS threads), so it is the work done, insensitive to other processes' load."""
    stamp: list[tuple[float, float]] = []

    def on_update(update) -> None:
        if update.tokens and not stamp:
            stamp.append((time.perf_counter(), time.process_time()))

    result = session.generate_async(list(tokens), GenConfig(max_new_tokens=1), on_update).wait(600)
    assert result.error is None and stamp, result.error
    return stamp[0][0] - started[0], stamp[0][1] - started[1]


def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def ttft(loaded, kind: str, lengths: list[int], repeats: int, rng: random.Random) -> list[dict]:
    """Median cold and hit TTFT per (prompt length, suffix); hits repeat 2x as often (they are cheap)."""
    vocab = loaded.config.vocab_size
    executor = ModuleExecutor.create(loaded, kind, max_sessions=8, max_session_tokens=max(lengths) + 64)
    runner = Runner(executor)
    cache = PrefixCache(RunnerBackend(runner), max_entries=4)
    rows = []
    try:
        warm = runner.open_session()
        timed_first_token(warm, [rng.randrange(200, vocab) for _ in range(64)], now())
        warm.close()
        for length in lengths:
            prompt = [rng.randrange(200, vocab) for _ in range(length)]
            source = runner.open_session()
            capture = cache.capture_prompt(source, prompt)
            source.generate_async(prompt, GenConfig(max_new_tokens=1), capture.wrap(None)).wait(600)
            assert capture.collect(NS) == 1
            source.close()
            for suffix in SUFFIXES:
                request = prompt + [rng.randrange(200, vocab) for _ in range(suffix)]
                colds, hits, lookups = [], [], []
                for i in range(2 * repeats):
                    if i < repeats:
                        session = runner.open_session()
                        colds.append(timed_first_token(session, request, now()))
                        session.close()
                    started = now()
                    match = cache.lookup(NS, request).match
                    lookups.append(time.perf_counter() - started[0])
                    assert match is not None and match.reused == length
                    hits.append(timed_first_token(match.session, request[match.reused :], started))
                    match.session.close()
                cold = statistics.median(wall for wall, _ in colds)
                hit = statistics.median(wall for wall, _ in hits)
                cold_cpu = statistics.median(cpu for _, cpu in colds)
                hit_cpu = statistics.median(cpu for _, cpu in hits)
                rows.append(
                    {
                        "cache_kind": kind,
                        "prompt_tokens": length,
                        "suffix_tokens": len(request) - length,
                        "cold_ttft_s": cold,
                        "hit_ttft_s": hit,
                        "hit_lookup_s": statistics.median(lookups),
                        "hit_over_cold": hit / cold,
                        "cold_cpu_s": cold_cpu,
                        "hit_cpu_s": hit_cpu,
                        "hit_over_cold_cpu": hit_cpu / cold_cpu,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        cache.clear()
        runner.shutdown()
    return rows


# --------------------------------------------------------------------------- lookup latency


class FreeBackend:
    """Clones cost nothing: the benchmark measures the prefix cache and its index only. A handle holds
    its tokens, so the cache's content check (digest of what the session holds) passes as on an engine."""

    fingerprint = "bench"

    class Handle:
        __slots__ = ("tokens",)

        def __init__(self, tokens: tuple[int, ...]) -> None:
            self.tokens = tokens

    def clone(self, handle, upto):
        return FreeBackend.Handle(handle.tokens[:upto])

    def close(self, handle) -> None:
        pass

    def position(self, handle) -> int:
        return len(handle.tokens)

    def content_digest(self, handle) -> bytes:
        return content_digest(handle.tokens)

    def valid(self, handle) -> bool:
        return True


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def lookup_latency(systems: int, per_system: int, key_len: int, samples: int, rng: random.Random) -> dict:
    pool = list(range(50_000))  # shared int objects: keys hold references, not 20M separate ints
    half = key_len // 2
    system_prompts = [[pool[rng.randrange(50_000)] for _ in range(half)] for _ in range(systems)]
    keys = []
    for system in system_prompts:
        for _ in range(per_system):
            keys.append(system + [pool[rng.randrange(50_000)] for _ in range(key_len - half)])
    backend = FreeBackend()
    cache = PrefixCache(backend, max_entries=len(keys))
    started = time.perf_counter()
    for key in keys:
        assert cache.insert(NS, key, FreeBackend.Handle(tuple(key))).stored
    insert_s = time.perf_counter() - started
    # Settle the heap after the bulk load, as a long-running service would be: the first full
    # collection untracks the 20M-int key tuples (they hold no containers), so later automatic
    # collections only walk the index nodes. Collections stay enabled while timing.
    gc.collect()

    def exact():
        key = rng.choice(keys)
        return list(key), key_len - 1

    def new_continuation():
        key = rng.choice(keys)
        cut = rng.randrange(half + 1, key_len)
        return key[:cut] + [50_001 + i for i in range(key_len - cut)], cut

    def inside_system():
        system = rng.choice(system_prompts)
        cut = rng.randrange(1, half)
        return system[:cut] + [50_001 + i for i in range(key_len - cut)], cut

    def miss():
        return [50_001 + i for i in range(key_len)], None

    result = {"entries": len(keys), "key_tokens": key_len, "insert_all_s": insert_s, "cases": {}}
    for name, make in (
        ("exact", exact),
        ("new_continuation", new_continuation),
        ("diverge_in_system", inside_system),
        ("miss", miss),
    ):
        times, cpu = [], []
        for _ in range(samples):
            request, reused = make()
            t0, c0 = time.perf_counter(), time.thread_time()
            match = cache.lookup(NS, request).match
            cpu.append(time.thread_time() - c0)
            times.append(time.perf_counter() - t0)
            assert (match.reused if match else None) == reused
        # Wall time is the target; thread CPU time shows what is left when the shared machine's
        # scheduler preempts this process (~4 ms time slices under load).
        result["cases"][name] = {
            "p50_ms": 1e3 * percentile(times, 0.5),
            "p99_ms": 1e3 * percentile(times, 0.99),
            "max_ms": 1e3 * max(times),
            "cpu_p99_ms": 1e3 * percentile(cpu, 0.99),
        }
        print(json.dumps({name: result["cases"][name]}), flush=True)
    return result


# --------------------------------------------------------------------------- report


def plot(rows: list[dict], lookup: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for kind, marker in (("batched-sequence", "o"), ("batched-cell", "s")):
        mine = [r for r in rows if r["cache_kind"] == kind]
        lengths = sorted({r["prompt_tokens"] for r in mine})
        cold = [statistics.median(r["cold_ttft_s"] for r in mine if r["prompt_tokens"] == n) for n in lengths]
        left.plot(lengths, cold, marker=marker, label=f"cold {kind}")
        for suffix in SUFFIXES:
            hit = [r["hit_ttft_s"] for r in mine if r["suffix_tokens"] == suffix]
            if len(hit) == len(lengths):
                left.plot(lengths, hit, marker=marker, linestyle="--", label=f"hit +{suffix} {kind}")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("cached prompt tokens")
    left.set_ylabel("time to first token (s)")
    left.set_title("TTFT: cold vs prefix-cache hit (suffix tokens)")
    left.legend(fontsize=7)
    names = list(lookup["cases"])
    x = range(len(names))
    right.bar([i - 0.2 for i in x], [lookup["cases"][n]["p50_ms"] for n in names], width=0.4, label="p50")
    right.bar([i + 0.2 for i in x], [lookup["cases"][n]["p99_ms"] for n in names], width=0.4, label="p99")
    right.axhline(1.0, color="red", linestyle=":", label="1 ms target")
    right.set_xticks(list(x), names, fontsize=8)
    right.set_ylabel("lookup latency (ms)")
    right.set_title(f"lookup, {lookup['entries']} entries x {lookup['key_tokens']} tokens (free clones)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 and 1024 tokens only, one repeat")
    parser.add_argument("--repeats", type=int, default=3, help="cold runs per point (hits run twice as many)")
    args = parser.parse_args()
    from engine_service.model.loading.loader import load_model

    rng = random.Random(0)
    lookup = lookup_latency(100, 100, 2000, 300 if args.quick else 2000, rng)
    loaded = load_model(None, "float32")
    lengths = [256, 1024] if args.quick else [256, 1024, 2048]
    rows = []
    for kind in ("batched-sequence", "batched-cell"):
        rows += ttft(loaded, kind, lengths, 1 if args.quick else args.repeats, rng)
    at_1024 = [r["hit_over_cold"] for r in rows if r["prompt_tokens"] == 1024]
    at_1024_cpu = [r["hit_over_cold_cpu"] for r in rows if r["prompt_tokens"] == 1024]
    report = {
        "ttft": rows,
        "lookup": lookup,
        "targets": {
            "hit_over_cold_at_1024_max": max(at_1024),
            "hit_over_cold_at_1024_ok": max(at_1024) < 1 / 50,
            "hit_over_cold_cpu_at_1024_max": max(at_1024_cpu),
            "lookup_cpu_p99_ms_max": max(c["cpu_p99_ms"] for c in lookup["cases"].values()),
            "lookup_p99_ms_max": max(c["p99_ms"] for c in lookup["cases"].values()),
            "lookup_p99_ok": max(c["p99_ms"] for c in lookup["cases"].values()) < 1.0,
        },
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_prefix.json").write_text(json.dumps(report, indent=2))
    plot(rows, lookup, OUT / "bench_prefix.png")
    print(json.dumps(report["targets"], indent=2))


if __name__ == "__main__":
    main()
