"""Prefill and decode throughput of the packaged SmolLM2-135M GGUF per weights dtype, with and without OpenBLAS.

    .venv/bin/python bench/bench_model.py [--quick]

Prints one JSON document and writes bench/out/bench_model.png. The reference-BLAS cases run in a
subprocess with FORKLINE_BLAS=reference (the BLAS is chosen when MLX is first imported). Cases that
are compute-bound on a slow kernel (the reference BLAS; decode through MLX's CPU quantized matmul) prefill fewer tokens
and decode fewer steps so the whole run stays within a few minutes; each result records what it measured.

Prefill: a fresh cache, ``n`` prompt tokens in chunks of 512, logits for the last row only; tokens/s of
the best of ``reps``. Decode: greedy steps after a 64-token prompt, one sequence, ``mx.async_eval``
pipelining (engine_service.greedy.greedy_tokens); tokens/s excludes the first token.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import engine_service  # noqa: E402,F401  (loads OpenBLAS before mlx unless FORKLINE_BLAS=reference)

DTYPES = ("float32", "float16", "bfloat16", "quantized")
# (blas, dtype) -> (prefill sizes, prefill reps, decode steps); chosen from measured kernel speeds on 2 cores
PLAN = {
    ("openblas", "float32"): ((512, 1024), 2, 48),
    ("openblas", "float16"): ((512, 1024), 2, 12),
    ("openblas", "bfloat16"): ((512, 1024), 2, 12),
    ("openblas", "quantized"): ((512, 1024), 2, 8),
    ("reference", "float32"): ((64,), 1, 6),
    ("reference", "float16"): ((64,), 1, 6),
    ("reference", "bfloat16"): ((64,), 1, 6),
    ("reference", "quantized"): ((64,), 1, 6),
}
PEERS = {"llama.cpp 2 threads (Q4_1)": (290, 90), "mlx-lm fp32 + OpenBLAS": (214, 18)}


def measure(dtype: str, sizes: tuple[int, ...], reps: int, decode_steps: int) -> dict:
    import mlx.core as mx

    from engine_service.blas import blas_status
    from engine_service.greedy import GenerationStats, greedy_tokens, new_cache, prefill
    from engine_service.model import load_model

    loaded = load_model(None, dtype)
    model = loaded.model
    vocab = loaded.config.vocab_size
    # a deterministic prompt of ordinary tokens (ids 1000.. avoid the special tokens at the start)
    prompt = [1000 + (i * 7919) % (vocab - 1000) for i in range(max(sizes))]
    result = {"dtype": dtype, "blas": blas_status().name, "prefill": {}}
    warm = new_cache(model, 65)  # first use JIT-compiles the fused kernels (fast_math): not timed
    mx.eval(prefill(model, warm, warm.seq_new(), prompt[:64]))
    for n in sizes:
        best = float("inf")
        for _ in range(reps):
            cache = new_cache(model, n + 1)
            seq = cache.seq_new()
            t0 = time.perf_counter()
            mx.eval(prefill(model, cache, seq, prompt[:n]))
            best = min(best, time.perf_counter() - t0)
        result["prefill"][str(n)] = round(n / best, 1)
    cache = new_cache(model, 64 + decode_steps + 1)
    stats = GenerationStats()
    for _ in greedy_tokens(model, cache, cache.seq_new(), prompt[:64], decode_steps, stats=stats):
        pass
    result["decode"] = round((stats.generated - 1) / stats.decode_s, 2)
    result["decode_steps"] = decode_steps
    return result


def run_cases(blas: str, dtypes: tuple[str, ...], quick: bool) -> list[dict]:
    out = []
    for dtype in dtypes:
        sizes, reps, steps = PLAN[(blas, dtype)]
        if quick:
            sizes, reps, steps = (min(sizes),), 1, min(steps, 8)
        out.append(measure(dtype, sizes, reps, steps))
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['dtype']}\n{r['blas']}" for r in results]
    xs = range(len(results))
    width = 0.2
    for k, size in enumerate(("64", "128", "512", "1024")):
        vals = [r["prefill"].get(size, 0) for r in results]
        ax1.bar([x + (k - 1.5) * width for x in xs], vals, width, label=f"prefill {size} tokens")
    ax2.bar(list(xs), [r["decode"] for r in results], 0.6, color="tab:green", label="decode")
    for name, (pre, dec) in PEERS.items():
        ax1.axhline(pre, linestyle="--", linewidth=1, color="gray")
        ax1.text(len(results) - 0.5, pre, name, fontsize=7, ha="right", va="bottom")
        ax2.axhline(dec, linestyle="--", linewidth=1, color="gray")
        ax2.text(len(results) - 0.5, dec, name, fontsize=7, ha="right", va="bottom")
    for ax, title in ((ax1, "prefill tokens/s"), (ax2, "decode tokens/s (1 sequence)")):
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(title)
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("SmolLM2-135M-Instruct (Q4_1 GGUF), MLX CPU, per weights dtype and BLAS")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small size per case (smoke run)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "reference": run in this process
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_cases(args.worker, DTYPES, args.quick)))
        return
    t0 = time.perf_counter()
    results = run_cases("openblas", DTYPES, args.quick)
    env = dict(os.environ, FORKLINE_BLAS="reference")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "reference"] + (
        ["--quick"] if args.quick else []
    )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    results += json.loads(proc.stdout.strip().splitlines()[-1])
    png = os.path.join(ROOT, "bench", "out", "bench_model.png")
    plot(results, png)
    print(
        json.dumps(
            {
                "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
                "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()],  # the 2 cores are shared
                "results": results,
                "peers_prefill_decode": PEERS,
                "plot": os.path.relpath(png, ROOT),
                "wall_s": round(time.perf_counter() - t0, 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
