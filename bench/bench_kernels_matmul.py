"""The compiled q8_0 / q4_1 kernels at decode shapes: per-call time, thread policy, rows, model decode.

    .venv/bin/python bench/bench_kernels_matmul.py [--quick] [--baseline PATH/_ext.so] [--no-model]

Prints one JSON document (also bench/out/bench_kernels_matmul.json). Everything is measured in one
process with the variants interleaved (medians over rounds), and each section records the machine
load (os.getloadavg) it ran under: compare ratios, not absolute times.

- ``per_call``: SmolLM2-135M's projections (q4_1: qkv [960x576], o [576x576], gate_up [3072x576],
  down [576x1536]) and the tied head (q8_0 [49152x576]) at 1 row, with 30 distinct copies of each
  projection called in turn so the weights stream from memory as in decode. Variants: ``t1`` (one
  thread), ``t2_always`` (two threads, every call shared and sleeping workers always woken),
  ``t2_policy`` (two threads, the default policy: the caller alone below parallel_us, sleepers woken
  from wake_us), and ``baseline`` (another build's _ext, e.g. the previous commit's, at two threads)
  when given. ``us``: one mx.eval per call, in a decode step's order (includes ``eval_overhead_us``;
  median, with ``p99_us`` and ``max_us``: a worker descheduled inside a task stalls its call);
  ``chained_us``: the same calls queued back to back in one evaluation, per call.
- ``rows``: GFLOP/s at 1-64 rows on one thread (the kernels' own speed, streaming weights), this build
  vs the baseline build; ``ratio_16`` is the 16-row ratio.
- ``model`` (the packaged SmolLM2 q4_1, when it loads): greedy decode tok/s after a 16-token prompt
  (engine_service.greedy: the next step's graph is built by Python while MLX runs this one) for t1,
  t2_always, t2_policy and, with --baseline, the baseline build's kernels swapped in.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import statistics
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import engine_service  # noqa: E402,F401,I001  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import forkline_kernels as fk  # noqa: E402

SHAPES = (("qkv", 960, 576, "q4_1"), ("o", 576, 576, "q4_1"), ("gate_up", 3072, 576, "q4_1"))
SHAPES += (("down", 576, 1536, "q4_1"), ("head", 49152, 576, "q8_0"))
LAYERS = 30
POLICIES = {
    "t2_always": dict(parallel_us=0.0, wake_us=0.0),
    "t2_policy": {},
}


def load_baseline(path: str):
    """Another build of the extension as module ``forkline_baseline._ext`` (its own worker pool)."""
    pkg = types.ModuleType("forkline_baseline")
    pkg.__path__ = []
    sys.modules["forkline_baseline"] = pkg
    loader = importlib.machinery.ExtensionFileLoader("forkline_baseline._ext", path)
    spec = importlib.util.spec_from_file_location("forkline_baseline._ext", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def weights(rng, n: int, k: int, fmt: str):
    scales = mx.array((rng.random((n, k // 32)) * 0.02).astype(np.float32))
    if fmt == "q8_0":
        return (mx.array(rng.integers(-127, 128, (n, k), dtype=np.int8)), scales)
    mins = mx.array((rng.standard_normal((n, k // 32)) * 0.1).astype(np.float32))
    return (mx.array(rng.integers(0, 256, (n, k // 2), dtype=np.uint8)), scales, mins)


def op_of(mod, fmt: str):
    return mod.q8_0_matmul if fmt == "q8_0" else mod.q4_1_matmul


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Variant:
    """A kernel module plus thread count and pool policy, applied before each measurement."""

    def __init__(self, mod, threads: int, policy: dict | None):
        self.mod, self.threads, self.policy = mod, threads, policy

    def apply(self, default_tuning: dict) -> None:
        if self.mod.num_threads() != self.threads:
            self.mod.set_num_threads(self.threads)
        if self.policy is not None:
            self.mod.set_pool_tuning(**{**default_tuning, **self.policy})


def variants(baseline) -> dict[str, Variant]:
    out = {"t1": Variant(fk, 1, {})}
    out.update({name: Variant(fk, 2, policy) for name, policy in POLICIES.items()})
    if baseline is not None:
        out["baseline"] = Variant(baseline, 2, None)
    return out


def timed(fn, reps: int) -> float:
    """Min over reps of one fn() evaluation (fn returns a list of lazy arrays)."""
    mx.eval(fn())
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def one_eval_us(fn) -> float:
    t0 = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - t0) * 1e6


def bench_per_call(rng, vs: dict[str, Variant], rounds: int, default_tuning: dict) -> dict:
    """Calls in a decode step's order (30 layers of qkv, o, gate_up, down, then the head), one eval
    each, so every call reads weights the previous calls evicted and pays the pool's wake-up."""
    mats = {}
    for name, n, k, fmt in SHAPES:
        mats[name] = [weights(rng, n, k, fmt) for _ in range(1 if name == "head" else LAYERS)]
        mx.eval(*[a for w in mats[name] for a in w])
    xs = {k: mx.array(rng.standard_normal((1, k)).astype(np.float32)) for k in (576, 1536)}
    mx.eval(*xs.values())
    null = [one_eval_us(lambda: [xs[576] + 1.0]) for _ in range(200)]
    times: dict[tuple[str, str], list[float]] = {}
    chained: dict[tuple[str, str], list[float]] = {}
    started = load()
    for _ in range(rounds):
        for vname, v in vs.items():
            v.apply(default_tuning)
            for sweep in range(2):  # the first warms the variant up
                for layer in range(LAYERS + 1):
                    for name, _n, k, fmt in SHAPES:
                        if (name == "head") != (layer == LAYERS):
                            continue
                        op, w, x = op_of(v.mod, fmt), mats[name][min(layer, len(mats[name]) - 1)], xs[k]
                        us = one_eval_us(lambda op=op, w=w, x=x: [op(x, *w)])
                        if sweep:
                            times.setdefault((name, vname), []).append(us)
            for name, _n, k, fmt in SHAPES:  # the same calls queued back to back in one evaluation
                op, ws, x = op_of(v.mod, fmt), mats[name] * (3 if name == "head" else 1), xs[k]
                us = timed(lambda op=op, ws=ws, x=x: [op(x, *w) for w in ws], 1) / len(ws) * 1e6
                chained.setdefault((name, vname), []).append(us)
    out = {
        "load_before": started,
        "load_after": load(),
        "eval_overhead_us": round(statistics.median(null), 1),  # an mx.eval of one trivial op
        "shapes": {},
    }
    for name, n, k, fmt in SHAPES:
        row = {vname: statistics.median(times[(name, vname)]) for vname in vs}
        chain = {vname: statistics.median(chained[(name, vname)]) for vname in vs}
        per_weight = 1.125 if fmt == "q8_0" else 0.75
        out["shapes"][name] = {
            "n": n,
            "k": k,
            "format": fmt,
            "us": {v: round(t, 1) for v, t in row.items()},  # one mx.eval per call (includes its overhead)
            "p99_us": {v: round(float(np.percentile(times[(name, v)], 99)), 1) for v in vs},
            "max_us": {v: round(max(times[(name, v)]), 1) for v in vs},
            "chained_us": {v: round(t, 1) for v, t in chain.items()},  # per call, queued in one eval
            "chained_weight_gbps": {v: round(n * k * per_weight / t / 1e3, 2) for v, t in chain.items()},
            "t2_policy_over_t1": round(row["t1"] / row["t2_policy"], 3),
            "t2_policy_over_t2_always": round(row["t2_always"] / row["t2_policy"], 3),
            "chained_t2_policy_over_t1": round(chain["t1"] / chain["t2_policy"], 3),
        }
        if "baseline" in vs:
            out["shapes"][name]["t2_policy_over_baseline"] = round(row["baseline"] / row["t2_policy"], 3)
            out["shapes"][name]["chained_t2_policy_over_baseline"] = round(
                chain["baseline"] / chain["t2_policy"], 3
            )
    return out


def bench_rows(rng, baseline, rounds: int, row_counts: tuple[int, ...]) -> dict:
    shapes = [s for s in SHAPES if s[0] != "head"]
    mods = {"this": fk} if baseline is None else {"this": fk, "baseline": baseline}
    mats = {}
    for name, n, k, _ in shapes:
        for fmt in ("q8_0", "q4_1"):
            mats[(name, fmt)] = [weights(rng, n, k, fmt) for _ in range(LAYERS)]
            mx.eval(*[a for w in mats[(name, fmt)] for a in w])
    for mod in mods.values():
        mod.set_num_threads(1)
    started = load()
    gflops: dict[tuple, list[float]] = {}
    for _ in range(rounds):
        for m in row_counts:
            xs = {k: mx.array(rng.standard_normal((m, k)).astype(np.float32)) for k in (576, 1536)}
            mx.eval(*xs.values())
            for mname, mod in mods.items():
                for (name, fmt), ws in mats.items():
                    _, n, k, _ = next(s for s in shapes if s[0] == name)
                    op, x = op_of(mod, fmt), xs[k]
                    # one eval over the 30 copies: each reads weights the others evicted
                    s = timed(lambda op=op, ws=ws, x=x: [op(x, *w) for w in ws], 3) / len(ws)
                    gflops.setdefault((name, fmt, m, mname), []).append(2 * m * n * k / s / 1e9)
    out = {"load_before": started, "load_after": load(), "threads": 1, "gflops": {}}
    for (name, fmt), _ in mats.items():
        entry = {}
        for m in row_counts:
            entry[str(m)] = {
                mname: round(statistics.median(gflops[(name, fmt, m, mname)]), 1) for mname in mods
            }
        if baseline is not None:
            for m in row_counts:
                e = entry[str(m)]
                e["ratio"] = round(e["this"] / e["baseline"], 3)
        out["gflops"][f"{name} {fmt}"] = entry
    return out


def bench_model(vs: dict[str, Variant], rounds: int, steps: int, default_tuning: dict) -> dict | None:
    try:
        from engine_service.greedy import greedy_tokens, new_cache
        from engine_service.model import cpu_kernels, load_model

        loaded = load_model(None, "q4_1")
    except Exception as exc:  # noqa: BLE001  (no packaged model here: skip the section)
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    model = loaded.model
    prompt = [(i * 37) % 4000 + 100 for i in range(16)]

    def decode() -> float:
        cache = new_cache(model, len(prompt) + steps + 2)
        stamps = []
        for _ in greedy_tokens(model, cache, cache.seq_new(), prompt, steps + 1):
            stamps.append(time.perf_counter())
        return steps / (stamps[-1] - stamps[0])

    decode()
    started = load()
    tok_s: dict[str, list[float]] = {name: [] for name in vs}
    own = cpu_kernels._module
    try:
        for _ in range(rounds):
            for name, v in vs.items():
                v.apply(default_tuning)
                cpu_kernels._module = v.mod  # the engine calls whichever module this is
                tok_s[name].append(decode())
    finally:
        cpu_kernels._module = own
    med = {name: statistics.median(x) for name, x in tok_s.items()}
    out = {
        "load_before": started,
        "load_after": load(),
        "decode_tok_s": {k: round(v, 1) for k, v in med.items()},
        "t2_policy_over_t1": round(med["t2_policy"] / med["t1"], 3),
        "t2_policy_over_t2_always": round(med["t2_policy"] / med["t2_always"], 3),
    }
    if "baseline" in med:
        out["t2_policy_over_baseline"] = round(med["t2_policy"] / med["baseline"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument(
        "--baseline", help="another build's _ext*.so to compare with (e.g. the last commit's)"
    )
    parser.add_argument("--no-model", action="store_true", help="skip the model decode section")
    parser.add_argument("--sections", default="per_call,rows,model")
    args = parser.parse_args()
    baseline = load_baseline(args.baseline) if args.baseline else None
    rounds = 3 if args.quick else 7
    rng = np.random.default_rng(0)
    default_tuning = dict(fk.pool_tuning())
    vs = variants(baseline)
    sections = set(args.sections.split(","))
    result = {"isa": fk.isa(), "cpus": os.cpu_count(), "pool_tuning": default_tuning}
    if "per_call" in sections:
        result["per_call"] = bench_per_call(rng, vs, rounds, default_tuning)
    if "rows" in sections:
        result["rows"] = bench_rows(rng, baseline, rounds, (1, 2, 4, 8, 16, 32, 64))
    if "model" in sections and not args.no_model:
        result["model"] = bench_model(vs, rounds, 24 if args.quick else 48, default_tuning)
    fk.set_pool_tuning(**default_tuning)
    out = os.path.join(ROOT, "bench", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_kernels_matmul.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
