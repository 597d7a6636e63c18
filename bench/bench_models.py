"""Per packaged model: prefill 512 / 1024 and decode at depth 16 / 1,536 tokens/s, resident weight
bytes, and (``--llama_bench PATH``) llama.cpp's figures on the same GGUF in the same run, as ratios;
then the sliding-window reuse case (``--reuse``): a prompt diverging inside a stored long one.

    .venv/bin/python bench/bench_models.py [--models gemma-3-270m smollm2-135m] [--quick]
        [--llama_bench /path/llama-bench] [--llama_server /path/llama-server] [--threads 2]

Prints one JSON document, writes bench/out/bench_models.png. forkline runs ``weights_dtype=auto``
(the lossless kernel formats); llama.cpp's bench runs with ``-t threads``. Prefill: a fresh cache,
chunks of 512, logits for the last row, best of ``reps``. Decode at depth d: prefill d tokens, then
greedy steps with ``mx.async_eval`` pipelining; tokens/s excludes the first token. The reuse case is
:mod:`bench.sliding_reuse` (engine + prefix service processes, and llama-server when given).
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import engine_service  # noqa: E402,F401  (loads OpenBLAS before mlx)

MODELS = ("gemma-3-270m", "smollm2-135m")


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def measure(name: str, quick: bool) -> dict:
    import mlx.core as mx

    from engine_service.greedy import GenerationStats, greedy_tokens, new_cache, prefill
    from engine_service.model import load_model

    loaded = load_model(name)
    model = loaded.model
    vocab = loaded.config.vocab_size
    sizes = (512,) if quick else (512, 1024)
    depths = (16,) if quick else (16, 1536)
    reps, steps = (1, 16) if quick else (2, 48)
    prompt = [1000 + (i * 7919) % (min(vocab, 60000) - 1000) for i in range(max(sizes + depths) + 1)]
    out = {
        "model": name,
        "file": os.path.basename(loaded.path),
        "weights_dtype": loaded.weights_dtype,
        "resident_weight_bytes": weight_bytes(model),
        "prefill": {},
        "decode": {},
    }
    warm = new_cache(
        model, 65, kv_dtype="auto"
    )  # the first forward JIT-compiles the fused kernels: not timed
    mx.eval(prefill(model, warm, warm.seq_new(), prompt[:64]))
    for n in sizes:
        best = float("inf")
        for _ in range(reps):
            cache = new_cache(model, n + 1, kv_dtype="auto")
            t0 = time.perf_counter()
            mx.eval(prefill(model, cache, cache.seq_new(), prompt[:n]))
            best = min(best, time.perf_counter() - t0)
        out["prefill"][str(n)] = round(n / best, 1)
    for depth in depths:
        cache = new_cache(model, depth + steps + 2, kv_dtype="auto")
        stats = GenerationStats()
        for _ in greedy_tokens(model, cache, cache.seq_new(), prompt[:depth], steps, stats=stats):
            pass
        out["decode"][str(depth)] = round((stats.generated - 1) / stats.decode_s, 2)
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def llama_bench(binary: str, path: str, threads: int, quick: bool) -> dict:
    """llama.cpp's prefill (pp) and decode-at-depth (tg at -d) tokens/s on ``path``."""
    sizes = "512" if quick else "512,1024"
    depths = "16" if quick else "16,1536"
    runs = [
        [binary, "-m", path, "-t", str(threads), "-p", sizes, "-n", "0", "-r", "2", "-o", "json"],
        [
            binary,
            "-m",
            path,
            "-t",
            str(threads),
            "-p",
            "0",
            "-n",
            "32",
            "-d",
            depths,
            "-r",
            "2",
            "-o",
            "json",
        ],
    ]
    out = {"prefill": {}, "decode": {}}
    for cmd in runs:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        for row in json.loads(proc.stdout):
            if row.get("n_prompt", 0) and not row.get("n_gen", 0):
                out["prefill"][str(row["n_prompt"])] = round(row["avg_ts"], 1)
            elif row.get("n_gen", 0):
                out["decode"][str(row.get("n_depth", 0))] = round(row["avg_ts"], 2)
    return out


def ratios(ours: dict, theirs: dict) -> dict:
    return {
        kind: {k: round(v / theirs[kind][k], 2) for k, v in ours[kind].items() if theirs[kind].get(k)}
        for kind in ("prefill", "decode")
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind, title in (
        (axes[0], "prefill", "prefill tokens/s"),
        (axes[1], "decode", "decode tokens/s at depth"),
    ):
        labels, ours, peer = [], [], []
        for r in results:
            for k, v in r[kind].items():
                labels.append(f"{r['model']}\n{k}")
                ours.append(v)
                peer.append(r.get("llama_cpp", {}).get(kind, {}).get(k, 0))
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], ours, 0.4, label="forkline (auto)")
        if any(peer):
            ax.bar([x + 0.2 for x in xs], peer, 0.4, label="llama.cpp")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("packaged models on this CPU, same GGUF files")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--quick", action="store_true", help="one size and depth per model (smoke run)")
    parser.add_argument("--llama_bench", default=None, metavar="PATH", help="llama.cpp's llama-bench binary")
    parser.add_argument(
        "--llama_server", default=None, metavar="PATH", help="llama.cpp's llama-server (reuse case)"
    )
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default: %(default)s)")
    parser.add_argument("--reuse", action="store_true", help="also run the sliding-window reuse case")
    args = parser.parse_args()
    t0 = time.perf_counter()
    results = []
    for name in args.models:
        r = measure(name, args.quick)
        if args.llama_bench:
            from engine_service.model.loading.packaged import resolve_model

            r["llama_cpp"] = llama_bench(args.llama_bench, resolve_model(name), args.threads, args.quick)
            r["ratio_vs_llama_cpp"] = ratios(r, r["llama_cpp"])
        results.append(r)
    report = {
        "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()],  # the 2 cores are shared
        "results": results,
    }
    if args.reuse:
        from sliding_reuse import run_reuse

        report["sliding_window_reuse"] = run_reuse(args.llama_server, args.threads, quick=args.quick)
    png = os.path.join(ROOT, "bench", "out", "bench_models.png")
    plot(results, png)
    report["plot"] = os.path.relpath(png, ROOT)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
