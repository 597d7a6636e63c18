"""Plain decode, forkline vs llama.cpp's ``llama-bench``, as back-to-back pairs (issue 38's last Done-when
item): for each model, ``--pairs`` rounds of (forkline greedy decode at each depth, then llama-bench
``-n 32 -d DEPTHS -r 1``) on the same GGUF and threads; per depth the median of the rounds' ratios, so the
machine's load drifts between rounds, not inside a ratio. Prints JSON, writes
bench/out/decode_pairs.json and a PNG (per-round ratios and their median at each depth).

    .venv/bin/python bench/bench_decode_pairs.py --llama_bench PATH [--models ...] [--pairs 3]
        [--prefill --depths 128 512]  (prefill tok/s of prompts of those sizes, llama-bench -p)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_vs_llamacpp import (  # noqa: E402  (OpenBLAS before mlx)
    DEPTHS,
    MODELS,
    forkline_decode,
    forkline_prefill,
    llama_bench,
    save_figure,
)


def pairs(
    name: str, binary: str, threads: int, rounds: int, depths: tuple[int, ...], steps: int, prefill: bool
) -> dict:
    """Per depth (decode) or prompt size (``prefill``): each round's ratio and their median."""
    from engine_service.model import load_model
    from engine_service.model.loading.packaged import resolve_model

    model = load_model(name).model
    forkline_decode(model, depths[:1], 8)  # warm: the first step builds the kernels' pools and caches
    path = resolve_model(name)
    rows = []
    for _ in range(rounds):
        if prefill:
            ours = forkline_prefill(model, depths)
            sizes = ",".join(map(str, depths))
            theirs = llama_bench(binary, path, threads, False, depths=(), reps=1, sizes=sizes)["prefill"]
        else:
            ours = forkline_decode(model, depths, steps)
            theirs = llama_bench(binary, path, threads, False, depths=depths, prefill=False, reps=1)
            theirs = theirs["decode"]
        rows.append({"forkline": ours, "llama_cpp": theirs})
    per_depth = {}
    for depth in map(str, depths):
        ratios = [r["forkline"][depth] / r["llama_cpp"][depth] for r in rows if r["llama_cpp"].get(depth)]
        per_depth[depth] = {
            "ratio_median": round(statistics.median(ratios), 2),
            "ratios": [round(x, 2) for x in ratios],
            "forkline_tok_s": [r["forkline"][depth] for r in rows],
            "llama_cpp_tok_s": [r["llama_cpp"].get(depth) for r in rows],
        }
    return per_depth


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = "prompt" if report["measures"] == "prefill" else "depth"
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, per_depth in report["models"].items():
        depths = list(per_depth)
        xs = range(len(depths))
        line = ax.plot(
            xs, [per_depth[d]["ratio_median"] for d in depths], marker="o", label=f"{name} (median)"
        )
        for x, d in zip(xs, depths, strict=True):
            ax.scatter(
                [x] * len(per_depth[d]["ratios"]), per_depth[d]["ratios"], s=10, color=line[0].get_color()
            )
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{label} {d}" for d in depths])
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel(f"forkline / llama-bench {report['measures']} tok/s")
    ax.set_title(f"plain {report['measures']}, back-to-back pairs")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama_bench", required=True, metavar="PATH")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--depths", nargs="+", type=int, default=list(DEPTHS))
    parser.add_argument("--steps", type=int, default=48, help="forkline decode steps per depth")
    parser.add_argument(
        "--prefill", action="store_true", help="prefill tok/s of prompts of --depths tokens instead"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "out", "decode_pairs.json"))
    args = parser.parse_args()
    if args.pairs < 1 or args.steps < 2 or not all(d > 0 for d in args.depths):
        parser.error("--pairs >= 1, --steps >= 2 and every depth > 0")
    t0 = time.perf_counter()
    report: dict = {
        "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()],
        "measures": "prefill" if args.prefill else "decode",
        "models": {},
    }
    for name in args.models:
        report["models"][name] = pairs(
            name, args.llama_bench, args.threads, args.pairs, tuple(args.depths), args.steps, args.prefill
        )
        print(json.dumps({name: report["models"][name]}), file=sys.stderr, flush=True)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(report, png)
    report["plot"] = os.path.relpath(png, ROOT)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
