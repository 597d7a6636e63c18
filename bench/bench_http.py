"""HTTP door benchmark on the real model (SmolLM2-135M-Instruct): OpenAI-compatible HTTP streaming vs the
prefix service's gRPC gateway, same engine, same prompt, same run.

1. One client: the same greedy chat generation (a prefix hit: the prompt was stored by a warm-up round)
   through the gRPC gateway (PrefixClient) and through ``POST /v1/chat/completions`` with
   ``stream: true`` (httpx, server-sent events parsed by the caller), --runs pairs.
   Tokens/s from request to last token and time to the first content token, both timed by the caller;
   the ratios are the median over back-to-back pairs (the order alternates), the absolute figures the
   best run. Target: HTTP >= 0.9 x gRPC on both (TTFT: gRPC / HTTP >= 0.9).
2. --clients concurrent clients on each door (one prompt each, all prefix hits): aggregate tokens/s,
   three back-to-back pairs (median ratio, best absolute figures).

Prints one JSON object, writes bench/out/bench_http.json and bench/out/bench_http.png.
Usage: .venv/bin/python bench/bench_http.py [--new-tokens 64] [--runs 9] [--clients 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import httpx

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from clients.engine_client import Tokens
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.executors.options import ExecutorSettings
from engine_service.model.loading.loader import load_model
from engine_service.rpc.server import create_server
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED
from prefix_service.engines.connect import connect_engine
from prefix_service.rpc.server import create_server as create_prefix_server

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
PROMPT = "Write a short story about a robot who learns to paint."
MODEL = "smollm2"


def grpc_run(prefix: PrefixClient, prompt: str, new_tokens: int) -> tuple[float, float, int]:
    """(ttft_s, total_s, tokens) through the gRPC gateway."""
    t0 = time.perf_counter()
    ttft, count = None, 0
    for event in prefix.generate(
        text=prompt, chat=True, config=GenConfig(max_new_tokens=new_tokens, temperature=0.0)
    ):
        if isinstance(event, Tokens) and event.text:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            count += len(event.ids)
    return ttft or 0.0, time.perf_counter() - t0, count


def http_run(http: httpx.Client, prompt: str, new_tokens: int) -> tuple[float, float, int]:
    """(ttft_s, total_s, tokens) through the HTTP door (tokens from the final usage chunk)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, count = None, 0
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.perf_counter() - t0
    return ttft or 0.0, time.perf_counter() - t0, count


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median of the pairwise ratios (pairs ran back to back)."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def concurrent(run, clients: int) -> float:
    """Aggregate tokens/s of ``clients`` threads each calling ``run(i)`` once, started together."""
    results: list[int] = [0] * clients
    barrier = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        barrier.wait()
        results[i] = run(i)[2]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if not all(results):
        raise RuntimeError("a client generated nothing")
    return sum(results) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--clients", type=int, default=8)
    args = p.parse_args()

    loaded = load_model()
    deps = EngineSessions.build(
        loaded,
        loaded.tokenizer,
        model_name=MODEL,
        chat=loaded.chat,
        executor=ExecutorSettings(
            max_sessions=3 * args.clients + 4, max_session_tokens=1024, max_decode_sequences=args.clients
        ),
        sessions=UNLIMITED,
    )
    server, port = create_server(deps, "127.0.0.1:0")
    gateway, channel = connect_engine(f"127.0.0.1:{port}", max_entries=2 * args.clients + 2)
    prefix_server, prefix_port = create_prefix_server(gateway, "127.0.0.1:0", channel=channel)
    http_port = prefix_server.start_http("127.0.0.1", 0, model_name=MODEL)
    prefix = PrefixClient(f"127.0.0.1:{prefix_port}", owner="bench")
    http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=300)
    results: dict = {"model": os.path.basename(loaded.path), "new_tokens": args.new_tokens, "runs": args.runs}
    try:
        # warm-up: stores the prompt (both doors share the namespace) and connects both clients
        grpc_run(prefix, PROMPT, 8)
        http_run(http, PROMPT, 8)

        grpc_runs, http_runs = [], []
        for run in range(args.runs):  # pairs, alternating which door goes first
            if run % 2:
                http_runs.append(http_run(http, PROMPT, args.new_tokens))
                grpc_runs.append(grpc_run(prefix, PROMPT, args.new_tokens))
            else:
                grpc_runs.append(grpc_run(prefix, PROMPT, args.new_tokens))
                http_runs.append(http_run(http, PROMPT, args.new_tokens))
        if {r[2] for r in grpc_runs} != {r[2] for r in http_runs}:
            raise RuntimeError(f"the doors generated different lengths: {grpc_runs} vs {http_runs}")
        grpc_tps = [n / total for _, total, n in grpc_runs]
        http_tps = [n / total for _, total, n in http_runs]
        results |= {
            "tokens": grpc_runs[0][2],
            "grpc_tokens_per_s": round(max(grpc_tps), 2),
            "http_tokens_per_s": round(max(http_tps), 2),
            "grpc_ttft_s": round(min(r[0] for r in grpc_runs), 4),
            "http_ttft_s": round(min(r[0] for r in http_runs), 4),
            # each pair ran back to back (same machine load): the median pair ratio is robust to a
            # neighbour's load changing between pairs
            "http_over_grpc_tokens_per_s": round(median_ratio(http_tps, grpc_tps), 3),
            "grpc_over_http_ttft": round(
                median_ratio([g[0] for g in grpc_runs], [h[0] for h in http_runs]), 3
            ),
            "grpc_runs_tokens_per_s": [round(x, 2) for x in grpc_tps],
            "http_runs_tokens_per_s": [round(x, 2) for x in http_tps],
        }

        prompts = [f"{PROMPT} Variant {i}." for i in range(args.clients)]
        for i in range(args.clients):  # store each client's prompt: every concurrent call is a hit
            grpc_run(prefix, prompts[i], 1)
        grpc_clients = [
            PrefixClient(f"127.0.0.1:{prefix_port}", owner=f"bench-{i}") for i in range(args.clients)
        ]
        http_clients = [
            httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=300) for _ in range(args.clients)
        ]
        grpc_aggs, http_aggs = [], []
        for _ in range(3):  # pairs, as above
            grpc_aggs.append(
                concurrent(lambda i: grpc_run(grpc_clients[i], prompts[i], args.new_tokens), args.clients)
            )
            http_aggs.append(
                concurrent(lambda i: http_run(http_clients[i], prompts[i], args.new_tokens), args.clients)
            )
        results |= {
            "clients": args.clients,
            "grpc_aggregate_tokens_per_s": round(max(grpc_aggs), 2),
            "http_aggregate_tokens_per_s": round(max(http_aggs), 2),
            "http_over_grpc_aggregate": round(median_ratio(http_aggs, grpc_aggs), 3),
        }
        for c in http_clients:
            c.close()
    finally:
        http.close()
        prefix_server.stop(0)
        server.stop(0, shutdown_runner=True)

    print(json.dumps(results, indent=2))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "bench_http.json"), "w") as f:
        json.dump(results, f, indent=2)
    plot(results, os.path.join(OUT, "bench_http.png"))


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    colors = ["tab:blue", "tab:orange"]
    axes[0].bar(["gRPC gateway", "HTTP SSE"], [r["grpc_tokens_per_s"], r["http_tokens_per_s"]], color=colors)
    axes[0].set_title(f"one client, {r['tokens']} tokens\nHTTP / gRPC = {r['http_over_grpc_tokens_per_s']}")
    axes[0].set_ylabel("tokens/s")
    axes[1].bar(
        ["gRPC gateway", "HTTP SSE"], [r["grpc_ttft_s"] * 1000, r["http_ttft_s"] * 1000], color=colors
    )
    axes[1].set_title(f"time to first token (prefix hit)\ngRPC / HTTP = {r['grpc_over_http_ttft']}")
    axes[1].set_ylabel("ms")
    axes[2].bar(
        ["gRPC gateway", "HTTP SSE"],
        [r["grpc_aggregate_tokens_per_s"], r["http_aggregate_tokens_per_s"]],
        color=colors,
    )
    axes[2].set_title(f"{r['clients']} concurrent clients\nHTTP / gRPC = {r['http_over_grpc_aggregate']}")
    axes[2].set_ylabel("aggregate tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
