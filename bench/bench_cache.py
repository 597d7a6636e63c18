"""Clone cost against prefix length for both cache kinds, on the real model's K/V geometry.

Geometry: 30 layers, kv_heads 3, head_dim 64, fp32 (SmolLM2-135M); all-full layers, plus a variant
whose odd layers slide (window 256, max_write 512). For each prefix length 64 .. 8192 it measures:

- clone time (median of repeats, clone evaluated) and K/V bytes copied (rows copied x row bytes, and
  the independent ``mx.get_active_memory()`` growth the clone leaves behind);
- the baseline: a plain copy (``mx.array(buffer[:, :L])`` + eval) of the same bytes;
- a packed decode step (8 sequences x 1 row, all 30 layers: begin_step + views + eval of state).

Targets, as ratios within this one run: a cell clone copies 0 K/V bytes and its time at 8192 is at
most 10% of the plain copy of that prefix (bookkeeping only); a sequence clone costs at most 2x the
plain copy of the bytes it copies. Prints JSON, writes bench/out/bench_cache.json and .png.

Usage: .venv/bin/python bench/bench_cache.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

import engine_service  # noqa: F401  (OpenBLAS before mlx)
from engine_service.cache.batch_control import Segment
from engine_service.cache.config import CacheConfig, LayerSpec
from engine_service.cache.registry import build_cache

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
ROW_BYTES = LAYERS * KV_HEADS * HEAD_DIM * 4 * 2  # one position's K and V on all layers, fp32
OUT = Path(__file__).resolve().parent / "out"


def config(sliding: bool, capacity: int) -> CacheConfig:
    layers = tuple(LayerSpec("sliding", 256) if sliding and i % 2 else LayerSpec() for i in range(LAYERS))
    return CacheConfig(
        capacity=capacity, max_seqs=16, layers=layers, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_write=512
    )


def append(cache, seq: int, n: int) -> None:
    """Write ``n`` random rows to ``seq`` in chunks of 512 (as the executor would)."""
    while n > 0:
        k = min(n, 512)
        rows = mx.random.normal((k, KV_HEADS, HEAD_DIM))
        step = cache.begin_step([Segment(seq, cache.pos(seq), k)])
        for layer in range(LAYERS):
            step.views(layer, rows, rows)
        mx.eval(step.state())
        n -= k


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copied_rows(cfg: CacheConfig, kind: str, upto: int) -> int:
    """K/V layer-rows (summed over layers) a clone at ``upto`` copies, from the documented layout."""
    if kind == "batched-cell":
        return 0
    rows = 0
    for spec in cfg.layers:
        if spec.sliding:
            slots = spec.window + cfg.max_write - 1
            rows += min(upto, slots) if upto <= slots else slots  # the filled ring
        else:
            rows += upto
    return rows


def clone_curve(kind: str, sliding: bool, lengths: list[int], repeats: int) -> list[dict]:
    cfg = config(sliding, capacity=2 * max(lengths) + 1024)
    cache = build_cache(kind, cfg)
    src = cache.seq_new()
    out = []
    for length in lengths:
        append(cache, src, length - cache.pos(src))
        mx.synchronize()
        mem0 = mx.get_active_memory()
        probe = cache.seq_clone(src, length)
        mx.eval([])  # the cache evaluates its copies itself
        grew = mx.get_active_memory() - mem0
        cache.seq_rm(probe)

        def once(cache=cache, length=length) -> None:
            sid = cache.seq_clone(src, length)
            assert sid is not None
            cache.seq_rm(sid)

        clone_s = median_time(once, repeats)
        rows = copied_rows(cfg, kind, length)
        out.append(
            {
                "prefix": length,
                "clone_s": clone_s,
                "kv_bytes_copied": rows * ROW_BYTES // LAYERS,
                "active_memory_growth": int(grew),
            }
        )
    return out


def plain_copy_curve(lengths: list[int], repeats: int) -> list[float]:
    """Time of mx.array copies of L rows of every layer's K and V buffer ([3, L, 64] each)."""
    buffers = [mx.random.normal((KV_HEADS, max(lengths) + 256, HEAD_DIM)) for _ in range(2 * LAYERS)]
    mx.eval(buffers)
    times = []
    for length in lengths:

        def once(length=length) -> None:
            mx.eval([mx.array(b[:, :length, :]) for b in buffers])

        times.append(median_time(once, repeats))
    return times


def decode_step(kind: str, context: int, seqs: int = 8, repeats: int = 5) -> float:
    """Seconds for one packed decode step of ``seqs`` sequences at ``context`` rows (no attention)."""
    cache = build_cache(kind, config(False, capacity=seqs * (context + 64)))
    ids = [cache.seq_new() for _ in range(seqs)]
    for sid in ids:
        append(cache, sid, context)
    rows = mx.random.normal((seqs, KV_HEADS, HEAD_DIM))
    mx.eval(rows)

    def once() -> None:
        step = cache.begin_step([Segment(s, cache.pos(s), 1) for s in ids])
        views = [v for layer in range(LAYERS) for v in step.views(layer, rows, rows)]
        mx.eval(step.state(), [v.keys for v in views])
        for s in ids:
            cache.rewind(s, context)

    once()
    return median_time(once, repeats)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = result["lengths"]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    ax_t.plot(lengths, [t * 1e3 for t in result["plain_copy_s"]], "k--", label="plain copy (same bytes)")
    for name, curve in result["clone"].items():
        ax_t.plot(lengths, [p["clone_s"] * 1e3 for p in curve], marker="o", label=name)
        ax_b.plot(lengths, [max(p["kv_bytes_copied"], 1) / 2**20 for p in curve], marker="o", label=name)
    for ax, label in ((ax_t, "clone time (ms)"), (ax_b, "K/V MiB copied (0 shown as 1 B)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prefix length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("KV cache clone cost (30 layers, 3 kv heads, head_dim 64, fp32)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="lengths up to 1024, fewer repeats")
    args = parser.parse_args()
    lengths = [64 * 2**i for i in range(5 if args.quick else 8)]  # 64 .. 8192
    repeats = 3 if args.quick else 5
    result: dict = {"lengths": lengths, "clone": {}}
    for kind in ("batched-sequence", "batched-cell"):
        for sliding in (False, True):
            name = f"{kind}{'/sliding' if sliding else '/full'}"
            result["clone"][name] = clone_curve(kind, sliding, lengths, repeats)
    result["plain_copy_s"] = plain_copy_curve(lengths, repeats)
    result["decode_step_s"] = {
        f"{kind}@{ctx}": decode_step(kind, ctx)
        for kind in ("batched-sequence", "batched-cell")
        for ctx in (256, 1024)
    }
    plain = result["plain_copy_s"]
    seq_full = result["clone"]["batched-sequence/full"]
    cell_full = result["clone"]["batched-cell/full"]
    seq_ratios = [p["clone_s"] / base for p, base in zip(seq_full, plain, strict=True)]
    # below initial_capacity (256) a clone also zero-fills headroom up to 256 rows: more bytes than the
    # prefix, so the 2x target is judged from 256 up (the per-length ratios are all reported)
    judged = [r for r, n in zip(seq_ratios, lengths, strict=True) if n >= 256]
    t = {
        "cell_kv_bytes_copied_total": sum(
            p["kv_bytes_copied"] + p["active_memory_growth"]
            for name, curve in result["clone"].items()
            if name.startswith("batched-cell")
            for p in curve
        ),
        "cell_clone_over_plain_copy_at_longest": cell_full[-1]["clone_s"] / plain[-1],
        "cell_clone_longest_over_shortest": cell_full[-1]["clone_s"] / cell_full[0]["clone_s"],
        "seq_clone_over_plain_copy": seq_ratios,
        "seq_clone_over_plain_copy_max_from_256": max(judged),
    }
    t["pass"] = (
        t["cell_kv_bytes_copied_total"] == 0
        and t["cell_clone_over_plain_copy_at_longest"] <= 0.1
        and t["seq_clone_over_plain_copy_max_from_256"] <= 2.0
    )
    result["targets"] = t
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_cache.json").write_text(json.dumps(result, indent=2))
    plot(result, OUT / "bench_cache.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
