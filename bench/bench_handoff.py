"""Prefill/decode hand-off (docs/RESUME.md#prefill-decode-hand-off) against colocated serving: two engine
processes of one model behind a prefix service, either both ``--role both`` (colocated, cost routing) or
one ``--role prefill`` and one ``--role decode`` (split). The same mixed trace on each: a few clients
decode short-prompt answers in a loop while long unique prompts arrive one after another. Per way:
the long prompts' time to first token (p50, p99), the decoders' inter-token latency (p50, p99) and
their tokens per second, and the positions one hand-off moves. Prints JSON, draws a PNG next to --out.

    .venv/bin/python bench/bench_handoff.py [--model smollm2] [--long 8] [--decoders 3]
        [--out bench/out/handoff.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_resume import free_port  # noqa: E402
from bench_workloads import ALIASES  # noqa: E402
from workload_servers import Process  # noqa: E402

import engine_service  # noqa: E402,F401  (loads OpenBLAS before mlx)
from clients.prefix_client import PrefixClient  # noqa: E402
from engine_service.api.config import GenConfig  # noqa: E402
from engine_service.api.stream_events import Tokens  # noqa: E402
from protos import prefix_pb2  # noqa: E402

WORDS = [
    "river",
    "bridge",
    "mill",
    "town",
    "valley",
    "stone",
    "water",
    "road",
    "field",
    "market",
    "tower",
    "wall",
    "gate",
    "path",
    "hill",
]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values) or [0.0]
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def run_way(model: str, roles: tuple[str, str], args: argparse.Namespace) -> dict:
    engines = [
        Process(["engine_service", "--model", model, "--port", str(free_port()), "--role", role], ["grpc"])
        for role in roles
    ]
    addresses = [a for e in engines for a in ("--engine", e.found["grpc"])]
    prefix = Process(["prefix_service", *addresses, "--port", "0"], ["grpc"])
    client = PrefixClient(prefix.found["grpc"], owner="bench", timeout=600)
    rng = random.Random(args.seed)
    gaps: list[float] = []
    decoded, stop = [0], threading.Event()

    def decoder(i: int) -> None:
        local = random.Random(i)
        while not stop.is_set():
            last = time.perf_counter()
            config = GenConfig(max_new_tokens=args.decode_tokens, temperature=0.0)
            for event in client.generate(
                text=text(local, 40), config=config, ignore_eos=True, namespace=f"d{i}"
            ):
                if isinstance(event, Tokens) and event.ids:
                    now = time.perf_counter()
                    gaps.extend([(now - last) / len(event.ids)] * len(event.ids))
                    decoded[0] += len(event.ids)
                    last = now

    threads = [threading.Thread(target=decoder, args=(i,), daemon=True) for i in range(args.decoders)]
    try:
        client.generate(text="warm up", config=GenConfig(max_new_tokens=4)).collect()
        for t in threads:
            t.start()
        time.sleep(2.0)
        gaps.clear()
        began, decoded[0] = time.perf_counter(), 0
        ttfts = []
        for _ in range(args.long):
            sent = time.perf_counter()
            for event in client.generate(
                text=text(rng, args.long_words), config=GenConfig(max_new_tokens=8), namespace="long"
            ):
                if isinstance(event, Tokens):
                    ttfts.append(time.perf_counter() - sent)
                    break
            time.sleep(args.spacing_s)
        elapsed = time.perf_counter() - began
        stop.set()
        for t in threads:
            t.join(120)
        stats = client.stub.Stats(prefix_pb2.StatsRequest(), timeout=30).engines
        return {
            "roles": list(roles),
            "long_ttft_p50_s": quantile(ttfts, 0.5),
            "long_ttft_p99_s": quantile(ttfts, 0.99),
            "itl_p50_s": quantile(gaps, 0.5),
            "itl_p99_s": quantile(gaps, 0.99),
            "decode_tok_s": round(decoded[0] / elapsed, 1),
            "moves": sum(e.moves_in for e in stats),
            "move_refusals": {k: v for e in stats for k, v in e.move_refusals.items()},
        }
    finally:
        stop.set()
        client.close_channel()
        for process in [prefix, *engines]:
            process.stop()


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = ["long_ttft_p50_s", "long_ttft_p99_s", "itl_p50_s", "itl_p99_s"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ways = list(report["ways"])
    for k, way in enumerate(ways):
        values = [report["ways"][way][f] * 1000 for f in figures]
        ax.bar([i + 0.4 * k - 0.2 for i in range(len(figures))], values, 0.4, label=way)
    ax.set_xticks(range(len(figures)), ["long TTFT p50", "long TTFT p99", "ITL p50", "ITL p99"])
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title(report["model"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--long", type=int, default=8, help="long prompts in the trace")
    parser.add_argument("--long_words", type=int, default=900, help="words per long prompt")
    parser.add_argument("--spacing_s", type=float, default=0.5, help="pause between long prompts")
    parser.add_argument("--decoders", type=int, default=3, help="clients decoding in a loop")
    parser.add_argument("--decode_tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "out", "handoff.json"))
    args = parser.parse_args()
    model = ALIASES.get(args.model, args.model)
    report = {"model": model, "load_average_1_5_15min": list(os.getloadavg()), "ways": {}}
    for way, roles in (("colocated", ("both", "both")), ("split", ("prefill", "decode"))):
        report["ways"][way] = run_way(model, roles, args)
        print(json.dumps({way: report["ways"][way]}), flush=True)
    co, sp = report["ways"]["colocated"], report["ways"]["split"]
    report["split_vs_colocated"] = {
        k: round(sp[k] / co[k], 3) if co[k] else None
        for k in ("long_ttft_p50_s", "long_ttft_p99_s", "itl_p50_s", "itl_p99_s", "decode_tok_s")
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
