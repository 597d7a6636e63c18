"""The two cache kinds side by side in one window (what the default kind is chosen by): a prefix hit's
clone and first token at each prefix length, a cold prefill, and decode tokens/s at each depth,
``batched-sequence`` vs ``batched-cell``, one in-process Runner per kind, rounds interleaved.

    .venv/bin/python bench/bench_cache_kinds.py [--model smollm2-135m] [--lengths 1520 4096]
        [--depths 512 1536 4096] [--out bench/out/bench_cache_kinds.json]

Prints JSON (ratios cell / sequence included) and draws a PNG beside ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from engine_service.api.config import GenConfig
from engine_service.executors.module import ModuleExecutor
from engine_service.model.loading.loader import load_model
from engine_service.runtime.runner import Runner

KINDS = ("batched-sequence", "batched-cell")
SUFFIX = 10  # positions a hit computes


def prompt_of(length: int) -> list[int]:
    return [1000 + (i * 7919) % 20000 for i in range(length)]


def hit_costs(runner: Runner, length: int, rounds: int) -> dict:
    """Clone a stored prompt ``SUFFIX`` positions short of its end and generate one token from it."""
    prompt = prompt_of(length)
    stored = runner.open_session()
    stored.generate_async(prompt, GenConfig(max_new_tokens=1)).wait()
    clone_s, hit_s = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        clone = stored.clone_async(length - SUFFIX).result()
        t1 = time.perf_counter()
        clone.generate_async(
            [*prompt[length - SUFFIX : length - 1], 5 + r], GenConfig(max_new_tokens=1)
        ).wait()
        clone_s.append(t1 - t0)
        hit_s.append(time.perf_counter() - t0)
        clone.close()
    stored.close()
    return {
        "clone_ms": 1000 * statistics.median(clone_s),
        "hit_first_token_ms": 1000 * statistics.median(hit_s),
    }


def decode_rate(runner: Runner, depth: int, tokens: int) -> float:
    session = runner.open_session()
    session.generate_async(prompt_of(depth), GenConfig(max_new_tokens=1)).wait()
    t0 = time.perf_counter()
    session.generate_async([5], GenConfig(max_new_tokens=tokens)).wait()
    rate = tokens / (time.perf_counter() - t0)
    session.close()
    return rate


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in KINDS:
        hits = report["hits"][kind]
        left.plot(
            [int(k) for k in hits], [v["hit_first_token_ms"] for v in hits.values()], marker="o", label=kind
        )
        decode = report["decode_tok_s"][kind]
        right.plot([int(k) for k in decode], list(decode.values()), marker="o", label=kind)
    left.set(xlabel="prefix reused (positions)", ylabel="hit first token (ms)", title="prefix hit")
    right.set(xlabel="depth (positions)", ylabel="decode tok/s", title="decode, one sequence")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"cache kinds, {report['model']} (one window)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", type=int, nargs="+", default=[1520, 4096])
    p.add_argument("--depths", type=int, nargs="+", default=[512, 1536, 4096])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode_tokens", type=int, default=48)
    p.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "bench_cache_kinds.json"),
    )
    args = p.parse_args()
    loaded = load_model(args.model)
    tokens = max(args.lengths + args.depths) + args.decode_tokens + 16
    runners = {
        k: Runner(ModuleExecutor.create(loaded, cache_kind=k, max_sessions=4, max_session_tokens=tokens))
        for k in KINDS
    }
    report: dict = {
        "model": args.model,
        "hits": {k: {} for k in KINDS},
        "decode_tok_s": {k: {} for k in KINDS},
    }
    try:
        for length in args.lengths:
            for kind, runner in runners.items():
                report["hits"][kind][str(length)] = hit_costs(runner, length, args.rounds)
        for depth in args.depths:
            rates: dict[str, list[float]] = {k: [] for k in KINDS}
            for _ in range(3):  # interleaved rounds: the machine's noise falls on both kinds
                for kind, runner in runners.items():
                    rates[kind].append(decode_rate(runner, depth, args.decode_tokens))
            for kind in KINDS:
                report["decode_tok_s"][kind][str(depth)] = round(statistics.median(rates[kind]), 1)
    finally:
        for runner in runners.values():
            runner.shutdown()
    seq, cell = (report["decode_tok_s"][k] for k in KINDS)
    report["decode_cell_over_sequence"] = {d: round(cell[d] / seq[d], 3) for d in seq}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
