"""Clone cost against prefix length for both cache kinds, on the real model's K/V geometry.

Geometry: 30 layers, kv_heads 3, head_dim 64, fp32 (SmolLM2-135M); all-full layers, plus a variant
whose odd layers slide (window 256, max_write 512). For each prefix length 64 .. 8192 it measures:

- clone time (median of repeats, clone evaluated) and K/V bytes copied (rows copied x row bytes, and
  the independent ``mx.get_active_memory()`` growth the clone leaves behind);
- the baseline: a plain copy (``mx.array(buffer[:, :L])`` + eval) of the same bytes the sequence
  clone copies (flat prefixes, whole rings), timed interleaved with the clone so load noise is shared;
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


def config(sliding: bool, capacity: int, max_seqs: int = 16) -> CacheConfig:
    layers = tuple(LayerSpec("sliding", 256) if sliding and i % 2 else LayerSpec() for i in range(LAYERS))
    return CacheConfig(
        capacity=capacity,
        max_seqs=max_seqs,
        layers=layers,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_write=512,
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


def median_times(fns, repeats: int) -> list[float]:
    """Median seconds of each function, the functions interleaved so load noise hits them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def source_buffers(cache, src: int, length: int) -> list[mx.array]:
    """The bytes a sequence clone at ``length`` copies: the first ``length`` rows of each flat layer and
    unwrapped ring, each wrapped ring's whole buffer; for the cell kind the prefix rows of each pool."""
    if hasattr(cache, "sequence"):
        seq = cache.sequence(src)
        out = []
        for layer in range(LAYERS):
            for buf in seq.buffers(layer):
                wrapped = seq.is_ring(layer) and seq.written > seq.slots(layer)
                out.append(buf if wrapped else buf[:, :length, :])
        return out
    return [pool[:, :length, :] for pool in (*cache._keys, *cache._values)]


def clone_curve(kind: str, sliding: bool, lengths: list[int], repeats: int) -> list[dict]:
    cfg = config(sliding, capacity=2 * max(lengths) + 1024)
    cache = build_cache(kind, cfg)
    src = cache.seq_new()
    out = []
    for length in lengths:
        append(cache, src, length - cache.pos(src))
        mx.synchronize()
        mem0 = mx.get_active_memory()
        probe = cache.seq_clone(src, length)  # the cache evaluates its copies itself
        grew = mx.get_active_memory() - mem0
        cache.seq_rm(probe)
        same_bytes = source_buffers(cache, src, length)

        def clone(cache=cache, length=length) -> None:
            sid = cache.seq_clone(src, length)
            assert sid is not None
            cache.seq_rm(sid)

        def plain(bufs=same_bytes) -> None:
            mx.eval([mx.array(b) for b in bufs])

        clone_s, plain_s = median_times([clone, plain], repeats)
        out.append(
            {
                "prefix": length,
                "clone_s": clone_s,
                "plain_copy_s": plain_s,
                "ratio": clone_s / plain_s,
                "kv_bytes_copied": 0 if kind == "batched-cell" else sum(b.nbytes for b in same_bytes),
                "active_memory_growth": int(grew),
            }
        )
    return out


def decode_step(kind: str, context: int, seqs: int = 8, repeats: int = 5) -> float:
    """Seconds for one packed decode step of ``seqs`` sequences at ``context`` rows (no attention)."""
    # as ModuleExecutor sizes it: capacity = sessions x tokens per session, max_seqs = sessions
    cache = build_cache(kind, config(False, capacity=seqs * (context + 64), max_seqs=seqs))
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
    return median_times([once], repeats)[0]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = result["lengths"]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in result["clone"].items():
        (line,) = ax_t.plot(lengths, [p["clone_s"] * 1e3 for p in curve], marker="o", label=name)
        if name.startswith("batched-sequence"):
            plain = [p["plain_copy_s"] * 1e3 for p in curve]
            ax_t.plot(lengths, plain, "--", color=line.get_color(), label=f"{name}: plain copy, same bytes")
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
    result["decode_step_s"] = {
        f"{kind}@{ctx}": decode_step(kind, ctx)
        for kind in ("batched-sequence", "batched-cell")
        for ctx in (256, 1024)
    }
    clone = result["clone"]
    seq_points = [p for name, c in clone.items() if name.startswith("batched-sequence") for p in c]
    cell_points = [p for name, c in clone.items() if name.startswith("batched-cell") for p in c]
    # below initial_capacity (256) a flat clone also zero-fills headroom up to 256 rows (more bytes than
    # the prefix), so the 2x target is judged from 256 up; every ratio is in the JSON
    t = {
        "cell_kv_bytes_copied_total": sum(
            p["kv_bytes_copied"] + p["active_memory_growth"] for p in cell_points
        ),
        "cell_clone_over_plain_copy_at_longest": max(c[-1]["ratio"] for n, c in clone.items() if "cell" in n),
        "cell_clone_longest_over_shortest": max(
            c[-1]["clone_s"] / c[0]["clone_s"] for n, c in clone.items() if "cell" in n
        ),
        "seq_clone_over_plain_copy_max_from_256": max(p["ratio"] for p in seq_points if p["prefix"] >= 256),
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
