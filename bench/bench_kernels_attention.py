"""Decode attention (one query row) of forkline_kernels.causal_attention vs MLX's fused attention.

    .venv/bin/python bench/bench_kernels_attention.py [--quick] [--baseline PATH/_ext.so]

Prints one JSON document (also bench/out/bench_kernels_attention.json). One process, variants
interleaved, medians over rounds; the machine load (os.getloadavg) is recorded with the results.

For SmolLM2-135M's layout (9 q heads, 3 kv heads, head_dim 64) and Gemma 3 270M's (4 q heads, 1 kv
head, head_dim 256), one query row at position S - 1 over S = 16 / 512 / 1,536 / 4,096 keys, with 30
layers' distinct K/V called in turn in one evaluation (so K/V stream from memory as in decode;
``us`` is per call). Variants:

- ``mlx_sdpa``: ``mx.fast.scaled_dot_product_attention`` on float32 [1, H, S, D] (one thread: MLX's
  CPU backend);
- ``f32_t1`` / ``f32_t2``: causal_attention on float32 K/V, 1 and 2 pool threads (at 2, a row's
  64-key chunks are spread over the threads);
- ``f16_t2`` / ``bf16_t2``: the same K/V stored as float16 / bfloat16, read as stored;
- ``baseline_f32`` / ``baseline_f16`` (with --baseline: another build's _ext, e.g. the last commit's,
  2 threads; its float16 path converted every part to float32 first).

``ratios``: mlx_sdpa / f32_t2 (speedup over MLX), f32_t1 / f32_t2 (threads), f32_t2 / f16_t2 (half
K/V), baseline_f32 / f32_t2.
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
sys.path.insert(0, os.path.join(ROOT, "bench"))

import engine_service  # noqa: E402,F401,I001  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import forkline_kernels as fk  # noqa: E402
from bench_kernels_matmul import load, load_baseline  # noqa: E402

LAYOUTS = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}
LENGTHS = (16, 512, 1536, 4096)
LAYERS = 30


def run_layout(rng, name: str, s: int, baseline, rounds: int) -> dict:
    hq, hkv, d = LAYOUTS[name]
    scale = d**-0.5
    qs = [mx.array((rng.standard_normal((1, hq, d)) * 0.5).astype(np.float32)) for _ in range(LAYERS)]
    ks = [mx.array(rng.standard_normal((hkv, s, d)).astype(np.float32)) for _ in range(LAYERS)]
    vs = [mx.array(rng.standard_normal((hkv, s, d)).astype(np.float32)) for _ in range(LAYERS)]
    k16, v16 = [k.astype(mx.float16) for k in ks], [v.astype(mx.float16) for v in vs]
    kb, vb = [k.astype(mx.bfloat16) for k in ks], [v.astype(mx.bfloat16) for v in vs]
    qp, kp = mx.array([s - 1], dtype=mx.int32), mx.arange(s, dtype=mx.int32)
    q4 = [q.transpose(1, 0, 2)[None] for q in qs]  # [1, Hq, 1, D]
    mx.eval(qs, ks, vs, k16, v16, kb, vb, qp, kp, q4)

    def ours(mod, keys, values):
        return lambda: [
            mod.causal_attention(qs[i], qp, [keys[i]], [values[i]], [kp], scale=scale) for i in range(LAYERS)
        ]

    variants = {
        "mlx_sdpa": (
            None,
            lambda: [
                mx.fast.scaled_dot_product_attention(q4[i], ks[i][None], vs[i][None], scale=scale)
                for i in range(LAYERS)
            ],
        ),
        "f32_t1": ((fk, 1), ours(fk, ks, vs)),
        "f32_t2": ((fk, 2), ours(fk, ks, vs)),
        "f16_t2": ((fk, 2), ours(fk, k16, v16)),
        "bf16_t2": ((fk, 2), ours(fk, kb, vb)),
    }
    if baseline is not None:
        variants["baseline_f32"] = ((baseline, 2), ours(baseline, ks, vs))
        variants["baseline_f16"] = ((baseline, 2), ours(baseline, k16, v16))
    # the kernels' outputs agree with MLX's (a check that the comparison is like for like)
    ref = np.array(variants["mlx_sdpa"][1]()[0])[0, :, 0]
    got = np.array(variants["f32_t2"][1]()[0])[0]
    assert np.allclose(ref, got, atol=1e-4), np.abs(ref - got).max()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for vname, (threads, fn) in variants.items():
            if threads is not None and threads[0].num_threads() != threads[1]:
                threads[0].set_num_threads(threads[1])
            mx.eval(fn())  # warm up
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                mx.eval(fn())
                best = min(best, time.perf_counter() - t0)
            times[vname].append(best / LAYERS * 1e6)
    us = {v: statistics.median(t) for v, t in times.items()}
    ratios = {
        "mlx_sdpa_over_f32_t2": us["mlx_sdpa"] / us["f32_t2"],
        "f32_t1_over_f32_t2": us["f32_t1"] / us["f32_t2"],
        "f32_t2_over_f16_t2": us["f32_t2"] / us["f16_t2"],
        "mlx_sdpa_over_f16_t2": us["mlx_sdpa"] / us["f16_t2"],
    }
    if baseline is not None:
        ratios["baseline_f32_over_f32_t2"] = us["baseline_f32"] / us["f32_t2"]
        ratios["baseline_f16_over_f16_t2"] = us["baseline_f16"] / us["f16_t2"]
    kv_bytes = 2 * hkv * s * d * 4
    return {
        "layout": name,
        "keys": s,
        "us": {v: round(t, 1) for v, t in us.items()},
        "f32_kv_gbps_t2": round(kv_bytes / us["f32_t2"] / 1e3, 2),
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument(
        "--baseline", help="another build's _ext*.so to compare with (e.g. the last commit's)"
    )
    args = parser.parse_args()
    baseline = load_baseline(args.baseline) if args.baseline else None
    rounds = 3 if args.quick else 5
    rng = np.random.default_rng(0)
    threads = fk.num_threads()
    started = load()
    rows = [run_layout(rng, name, s, baseline, rounds) for name in LAYOUTS for s in LENGTHS]
    fk.set_num_threads(threads)
    result = {"isa": fk.isa(), "load_before": started, "load_after": load(), "decode_attention": rows}
    out = os.path.join(ROOT, "bench", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_kernels_attention.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
