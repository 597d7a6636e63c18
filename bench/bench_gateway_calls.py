"""Engine calls and time to first token per prefix hit through the HTTP door, on the tiny model.

An engine (the tiny seeded model of the tests, char tokenizer, chatml template) with its RPC metrics,
a prefix service over it with its OpenAI-compatible HTTP door, all in one process. A warm-up request
stores the chat prompt; then --runs identical streamed ``/v1/chat/completions`` requests are prefix
hits. For each: the engine RPCs it caused (the engine's ``forkline_rpc_requests_total`` by method,
read before and after, health checks left out) and its time to first token (request sent -> the
first chunk carrying content or a finish reason), timed by the caller. The same for the gRPC gateway
(``PrefixClient.generate``, text) for comparison.

Prints one JSON object and writes bench/out/bench_gateway_calls.json.
Usage: .venv/bin/python bench/bench_gateway_calls.py [--runs 200] [--new-tokens 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.executors.options import ExecutorSettings
from engine_service.model.random_init import random_model
from engine_service.model.text.chat import ChatFormatter
from engine_service.rpc.server import create_server
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED
from prefix_service.engines.connect import connect_engine
from prefix_service.rpc.server import create_server as create_prefix_server

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
MODEL = "tiny"
SYSTEM = "You are a terse assistant. Answer in one short sentence, no lists, no code. " * 2
QUESTION = "What is the capital of France?"


def engine_calls(registry) -> Counter[str]:
    """Engine RPCs handled so far, by method (health checking left out)."""
    calls: Counter[str] = Counter()
    for metric in registry.collect():
        if metric.name != "forkline_rpc_requests":
            continue
        for sample in metric.samples:
            if sample.name.endswith("_total") and "Health" not in sample.labels["service"]:
                calls[sample.labels["method"]] += int(sample.value)
    return calls


def http_hit(http: httpx.Client, new_tokens: int) -> float:
    """One streamed chat request; seconds to the first chunk with content or a finish reason."""
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = None
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if ttft is None and (choice["delta"].get("content") or choice.get("finish_reason")):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("the stream carried no token")
    return ttft


def grpc_hit(prefix: PrefixClient, new_tokens: int) -> float:
    t0 = time.perf_counter()
    ttft = None
    for _event in prefix.generate(
        text=QUESTION, chat=True, system=SYSTEM, config=GenConfig(max_new_tokens=new_tokens, temperature=0.0)
    ):
        if ttft is None and type(_event).__name__ in ("Tokens", "Done"):
            ttft = time.perf_counter() - t0
    return ttft or 0.0


def measure(run, registry, runs: int) -> dict:
    """``run()`` ``runs`` times: engine calls per request by method, TTFT median and spread (ms)."""
    per_request: list[Counter[str]] = []
    ttfts: list[float] = []
    for _ in range(runs):
        before = engine_calls(registry)
        ttfts.append(run())
        time.sleep(0.005)  # the cleanup after the last event (a Close) lands in the counts
        per_request.append(engine_calls(registry) - before)
    total: Counter[str] = sum(per_request, Counter())
    ms = sorted(t * 1e3 for t in ttfts)
    return {
        "engine_calls_per_hit": round(sum(total.values()) / runs, 3),
        "by_method": {m: round(n / runs, 3) for m, n in sorted(total.items())},
        "ttft_ms_median": round(statistics.median(ms), 3),
        "ttft_ms_p10": round(ms[len(ms) // 10], 3),
        "ttft_ms_p90": round(ms[(9 * len(ms)) // 10], 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=4)
    args = p.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tiny-model tokenizer
    from tests.service.conftest import char_tokenizer

    deps = EngineSessions.build(
        random_model("FRFR", 4, 0),
        char_tokenizer(),
        model_name=MODEL,
        chat=ChatFormatter(name="chatml"),
        executor=ExecutorSettings(max_sessions=16, max_session_tokens=512, prefill_chunk=64),
        sessions=UNLIMITED,
    )
    server, port = create_server(deps, "127.0.0.1:0", metrics=True)
    gateway, channel = connect_engine(f"127.0.0.1:{port}", max_entries=8)
    prefix_server, prefix_port = create_prefix_server(gateway, "127.0.0.1:0", channel=channel)
    http_port = prefix_server.start_http("127.0.0.1", 0, model_name=MODEL)
    http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60)
    prefix = PrefixClient(f"127.0.0.1:{prefix_port}", owner="bench")
    registry = server.metrics.registry
    results: dict = {"model": MODEL, "runs": args.runs, "new_tokens": args.new_tokens}
    try:
        for _ in range(3):  # warm-up: stores the prompt, connects, compiles
            http_hit(http, args.new_tokens)
            grpc_hit(prefix, args.new_tokens)
        results["http"] = measure(lambda: http_hit(http, args.new_tokens), registry, args.runs)
        results["grpc"] = measure(lambda: grpc_hit(prefix, args.new_tokens), registry, args.runs)
        stats = prefix.stats()
        results["prefix_hits"] = stats.hits
    finally:
        http.close()
        prefix_server.stop(0)
        server.stop(0, shutdown_runner=True)
    print(json.dumps(results, indent=2))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "bench_gateway_calls.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
