"""The compiled CPU kernels (q8_0, q4_1) against float32 OpenBLAS, on SmolLM2-135M's shapes and model.

    .venv/bin/python bench/bench_kernels.py [--quick]

Prints one JSON document and writes bench/out/bench_kernels.png. All ratios come from one run.

- matmul: ``x [M, K] @ W.T`` for each projection shape of the packaged model (fused q/k/v and gate/up,
  o, down, the tied head), M = 1 and 8: median seconds over ``reps``, GFLOP/s (2*M*N*K) and weight
  GB/s (the bytes of W the call reads: float32 4, q8_0 1.125, q4_1 0.75 per weight).
- model: greedy decode tok/s of one sequence after a 64-token prompt (engine_service.greedy, pipelined
  with mx.async_eval; the first token excluded), prefill tok/s of 512 tokens, resident weight bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import engine_service  # noqa: E402,F401,I001  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from engine_service.model.block_quant import block_matmul, to_q4_1, to_q8_0  # noqa: E402
from engine_service.model.cpu_kernels import kernel_status  # noqa: E402

FORMATS = ("float32", "q8_0", "q4_1")
# (name, N, K) of SmolLM2-135M: hidden 576, 9 q heads + 3 kv heads of 64, intermediate 1536, vocab 49152
SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("head", 49152, 576))
BYTES_PER_WEIGHT = {"float32": 4.0, "q8_0": 1.125, "q4_1": 0.75}


def time_call(fn, reps: int) -> float:
    mx.eval(fn())  # warm up (first call allocates, starts the pool)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_matmuls(reps: int) -> list[dict]:
    rows = []
    for name, n, k in SHAPES:
        w = mx.random.normal((n, k), key=mx.random.key(n + k)) * 0.05
        weights = {"float32": w, "q8_0": to_q8_0(w), "q4_1": to_q4_1(w)}
        mx.eval(w, *(t.wq for t in list(weights.values())[1:]))
        for m in (1, 8):
            x = mx.random.normal((m, k), key=mx.random.key(m))
            mx.eval(x)
            for fmt, t in weights.items():
                fn = (lambda x=x, t=t: x @ t.T) if fmt == "float32" else (lambda x=x, t=t: block_matmul(x, t))
                s = time_call(fn, reps)
                rows.append({
                    "shape": name, "n": n, "k": k, "m": m, "format": fmt, "seconds": s,
                    "gflops": 2 * m * n * k / s / 1e9, "weight_gbps": n * k * BYTES_PER_WEIGHT[fmt] / s / 1e9,
                })
    return rows


def bench_model(fmt: str, decode_steps: int, prefill_tokens: int) -> dict:
    from engine_service.greedy import greedy_tokens, new_cache, prefill
    from engine_service.model import load_model

    loaded = load_model(None, fmt)
    model = loaded.model
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    prompt = [(i * 37) % 4000 + 100 for i in range(64)]
    cache = new_cache(model, len(prompt) + decode_steps + 2)
    stamps = []
    for _ in greedy_tokens(model, cache, cache.seq_new(), prompt, decode_steps + 1):
        stamps.append(time.perf_counter())
    decode = decode_steps / (stamps[-1] - stamps[0])
    long_prompt = [(i * 53) % 4000 + 100 for i in range(prefill_tokens)]
    best = float("inf")
    for _ in range(2):
        cache = new_cache(model, prefill_tokens + 1)
        t0 = time.perf_counter()
        mx.eval(prefill(model, cache, cache.seq_new(), long_prompt))
        best = min(best, time.perf_counter() - t0)
    return {"format": loaded.weights_dtype, "decode_tok_s": decode, "prefill_tokens": prefill_tokens,
            "prefill_tok_s": prefill_tokens / best, "weight_bytes": weight_bytes}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    models = result["model"]
    ax1.bar([m["format"] for m in models], [m["decode_tok_s"] for m in models], color=["#888", "#3a7", "#37a"])
    for i, m in enumerate(models):
        ax1.text(i, m["decode_tok_s"], f"{m['decode_tok_s']:.1f}", ha="center", va="bottom")
    ax1.set_title("SmolLM2-135M decode, 1 sequence (tok/s)")
    names = [f"{name}\nM={m}" for name, _, _ in SHAPES for m in (1, 8)]
    width = 0.27
    for j, fmt in enumerate(FORMATS):
        vals = [r["weight_gbps"] for r in result["matmul"] if r["format"] == fmt]
        ax2.bar([i + (j - 1) * width for i in range(len(vals))], vals, width, label=fmt)
    ax2.set_xticks(range(len(names)), names, fontsize=7)
    ax2.set_ylabel("weight GB/s")
    ax2.set_title("x @ W.T: weight bytes read per second")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and decode steps")
    args = parser.parse_args()
    status = kernel_status()
    if not status.available:
        sys.exit(f"bench_kernels: {status.describe()}")
    reps, steps = (5, 16) if args.quick else (20, 48)
    result = {
        "kernels": status.describe(),
        "matmul": bench_matmuls(reps),
        "model": [bench_model(fmt, steps, 512) for fmt in FORMATS],
    }
    base = result["model"][0]
    result["ratios_vs_float32"] = {
        m["format"]: {
            "decode": m["decode_tok_s"] / base["decode_tok_s"],
            "prefill": m["prefill_tok_s"] / base["prefill_tok_s"],
            "weight_bytes": m["weight_bytes"] / base["weight_bytes"],
        }
        for m in result["model"][1:]
    }
    out = os.path.join(ROOT, "bench", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_kernels.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out, "bench_kernels.png"))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
