"""A prefix hit's first token through both HTTP doors, forkline (engine + prefix service, default flags)
and llama-server (``-np 4 -c 16384``), one server at a time, one window: a system prompt of ~1,500 and
~4,000 tokens with one question (cold), then six other questions after the same system prompt (hits:
what each answers first is the question's suffix). Per model, length and server: TTFT cold and of the
hits (p50), the cached tokens the server reports, decode tokens/s of the hits' answers; ratios forkline /
llama-server. Prints JSON, draws a PNG next to --out.

    .venv/bin/python bench/bench_http_hits.py [--models smollm2 gemma3] [--lengths 1500 4000]
        [--llama_server PATH | --no_llama] [--out bench/out/http_hits.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_workloads import ALIASES, BASE_MODELS, LLAMA_CTX, LLAMA_SERVER, ratio  # noqa: E402
from workload_client import body_for, stream  # noqa: E402
from workload_servers import Forkline  # noqa: E402
from workload_shapes import Item, Words  # noqa: E402

import engine_service  # noqa: E402,F401  (loads OpenBLAS before mlx)

HITS = 6


def run_lengths(base: str, model: str, words: Words, lengths: list[int], chat: bool, seed: int) -> dict:
    """Per length: one cold request, then :data:`HITS` hits over the same system prompt."""
    out = {}
    for length in lengths:
        rng = random.Random(seed + length)
        system = words.text(rng, length)
        questions = [words.text(rng, 12) + "?" for _ in range(HITS + 1)]
        sents = []
        for i, question in enumerate(questions):
            item = Item(system=system, turns=(question,), max_tokens=8 if i == 0 else 24)
            sents.append(stream(base, body_for(item, [], 0, chat, model), time.perf_counter()))
        errors = [s.error for s in sents if s.error]
        if errors:
            raise RuntimeError(f"{base}: {errors[0]}")
        hits = sents[1:]
        out[str(length)] = {
            "prompt_tokens": hits[0].prompt_tokens,
            "cold_ttft_s": round(sents[0].ttft_s, 4),
            "hit_ttft_s": [round(s.ttft_s, 4) for s in hits],
            "hit_ttft_p50_s": round(statistics.median(s.ttft_s for s in hits), 4),
            "hit_cached_tokens": [s.cached_tokens for s in hits],
        }
    return out


def run_model(name: str, args: argparse.Namespace) -> dict:
    from engine_service.model import load_model
    from engine_service.model.loading.packaged import resolve_model

    loaded = load_model(name)
    words, chat = Words(loaded.tokenizer), name not in BASE_MODELS
    out: dict = {"route": "/v1/chat/completions" if chat else "/v1/completions"}
    server = Forkline(name)
    try:
        out["forkline"] = run_lengths(server.base, name, words, args.lengths, chat, args.seed)
    finally:
        server.close()
    print(json.dumps({name: {"forkline": out["forkline"]}}), file=sys.stderr, flush=True)
    if args.llama_server:
        from llama_server import LlamaServer

        with LlamaServer(
            args.llama_server, resolve_model(name), threads=args.threads, ctx=LLAMA_CTX, slots=4
        ) as s:
            out["llama_server"] = run_lengths(s.base, "model", words, args.lengths, chat, args.seed)
        out["ratios"] = {
            length: {
                "hit_ttft_p50": ratio(mine["hit_ttft_p50_s"], theirs["hit_ttft_p50_s"]),
                "cold_ttft": ratio(mine["cold_ttft_s"], theirs["cold_ttft_s"]),
            }
            for (length, mine), theirs in zip(
                out["forkline"].items(), out["llama_server"].values(), strict=True
            )
        }
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, mine, theirs = [], [], []
    for name, r in report["models"].items():
        for length, row in r["forkline"].items():
            labels.append(f"{name}\n{row['prompt_tokens']} tok")
            mine.append(row["hit_ttft_p50_s"] * 1000)
            theirs.append(r.get("llama_server", {}).get(length, {}).get("hit_ttft_p50_s", 0) * 1000)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], mine, 0.4, label="forkline")
    ax.bar([i + 0.2 for i in x], theirs, 0.4, label="llama-server")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("prefix hit, first token p50 (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1500, 4000])
    parser.add_argument(
        "--llama_server", default=LLAMA_SERVER if os.path.exists(LLAMA_SERVER) else None, metavar="PATH"
    )
    parser.add_argument("--no_llama", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(HERE, "out", "http_hits.json"))
    args = parser.parse_args()
    args.llama_server = None if args.no_llama else args.llama_server
    report = {"hits": HITS, "models": {}}
    for model in args.models:
        name = ALIASES.get(model, model)
        report["models"][name] = run_model(name, args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
