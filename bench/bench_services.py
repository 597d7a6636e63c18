"""Services benchmark on the real model (SmolLM2-135M-Instruct): what gRPC costs and what the gateway saves.

1. The same greedy generation in-process (Runner API, no gRPC) and through the engine's gRPC stream,
   on the same engine: tokens/s of each measured by the caller from request to last token (target:
   gRPC >= 0.95 x in-process, one run each after a warm-up).
2. Time to first token at a 1024-token prompt: cold (engine Generate, nothing cached) vs a prefix
   gateway hit (the second round of the same prompt replays one token).
3. 16 concurrent clients streaming through the engine: aggregate tokens/s and p50 / p99 TTFT.

Prints one JSON object, writes bench/out/bench_services.json and bench/out/bench_services.png.
Usage: .venv/bin/python bench/bench_services.py [--new-tokens 64] [--clients 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from clients.engine_client import EngineClient, Tokens
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


def timed_stream(stream) -> tuple[float, float, int]:
    """(ttft_s, total_s, tokens) of a GenerationStream, timed by the caller."""
    t0 = time.perf_counter()
    ttft = None
    count = 0
    for event in stream:
        if isinstance(event, Tokens) and event.ids:
            if ttft is None:
                ttft = time.perf_counter() - t0
            count += len(event.ids)
    return ttft or 0.0, time.perf_counter() - t0, count


def in_process(runner, prompt: list[int], new_tokens: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first: list[float] = []

    def on_update(update) -> None:
        if update.tokens and not first:
            first.append(time.perf_counter() - t0)

    with runner.open_session() as session:
        config = GenConfig(max_new_tokens=new_tokens)
        result = session.generate_async(prompt, config, on_update).wait()
    return first[0], time.perf_counter() - t0, len(result.tokens)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--long-prompt", type=int, default=1024)
    args = p.parse_args()

    loaded = load_model()
    tok = loaded.tokenizer
    deps = EngineSessions.build(
        loaded,
        tok,
        model_name="smollm2",
        chat=loaded.chat,
        executor=ExecutorSettings(
            max_sessions=args.clients + 4, max_session_tokens=2048, max_decode_sequences=args.clients
        ),
        sessions=UNLIMITED,
    )
    server, port = create_server(deps, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    prefix_deps, channel = connect_engine(address, max_entries=8)
    prefix_server, prefix_port = create_prefix_server(prefix_deps, "127.0.0.1:0", channel=channel)
    engine = EngineClient(address, owner="bench")
    results: dict = {"model": os.path.basename(loaded.path), "new_tokens": args.new_tokens}
    try:
        prompt = tok.encode(loaded.chat.format([{"role": "user", "content": PROMPT}]))
        config = GenConfig(max_new_tokens=args.new_tokens)
        # warm-up both paths once (MLX compiles kernels, gRPC connects)
        in_process(deps.runner, prompt, 8)
        timed_stream(engine.generate(prompt, config=GenConfig(max_new_tokens=8), ignore_eos=True))

        # 1. in-process vs gRPC (interleaved, best of 3 each so a noisy neighbour hurts both alike)
        local_runs, remote_runs = [], []
        for _ in range(3):
            _, total, n = in_process(deps.runner, prompt, args.new_tokens)
            local_runs.append(n / total)
            _, total, n = timed_stream(engine.generate(prompt, config=config, ignore_eos=True))
            remote_runs.append(n / total)
        local, remote = max(local_runs), max(remote_runs)
        results["in_process_tokens_per_s"] = round(local, 2)
        results["grpc_tokens_per_s"] = round(remote, 2)
        results["grpc_over_in_process"] = round(remote / local, 3)
        results["in_process_runs"] = [round(x, 2) for x in local_runs]
        results["grpc_runs"] = [round(x, 2) for x in remote_runs]

        # 2. TTFT at a long prompt: cold vs gateway hit
        words = tok.encode("The lighthouse keeper climbed the narrow stairs every evening at dusk. " * 150)
        long_prompt = words[: args.long_prompt]
        gateway = PrefixClient(f"127.0.0.1:{prefix_port}", owner="bench")
        cold_ttft, _, _ = timed_stream(
            engine.generate(long_prompt, config=GenConfig(max_new_tokens=4), ignore_eos=True)
        )
        timed_stream(
            gateway.generate(long_prompt, config=GenConfig(max_new_tokens=4), ignore_eos=True)
        )  # miss: stores it
        hit_ttft, _, _ = timed_stream(
            gateway.generate(long_prompt, config=GenConfig(max_new_tokens=4), ignore_eos=True)
        )
        results["long_prompt_tokens"] = len(long_prompt)
        results["ttft_cold_s"] = round(cold_ttft, 4)
        results["ttft_gateway_hit_s"] = round(hit_ttft, 4)
        results["ttft_speedup"] = round(cold_ttft / hit_ttft, 1)

        # 3. concurrent clients
        prompts = [
            tok.encode(loaded.chat.format([{"role": "user", "content": f"{PROMPT} Variant {i}."}]))
            for i in range(args.clients)
        ]
        stats: list[tuple[float, float, int] | None] = [None] * args.clients
        start = threading.Barrier(args.clients + 1)

        def client(i: int) -> None:
            c = EngineClient(address, owner=f"bench-{i}")
            start.wait()
            stats[i] = timed_stream(
                c.generate(prompts[i], config=GenConfig(max_new_tokens=args.new_tokens), ignore_eos=True)
            )
            c.close_channel()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        done = [s for s in stats if s is not None]
        if len(done) < args.clients:
            raise RuntimeError(f"{args.clients - len(done)} of {args.clients} clients failed")
        ttfts = [s[0] for s in done]
        results["clients"] = args.clients
        results["aggregate_tokens_per_s"] = round(sum(s[2] for s in done) / wall, 2)
        results["ttft_p50_s"] = round(statistics.median(ttfts), 3)
        results["ttft_p99_s"] = round(percentile(ttfts, 99), 3)
    finally:
        prefix_server.stop(0)
        server.stop(0, shutdown_runner=True)

    print(json.dumps(results, indent=2))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "bench_services.json"), "w") as f:
        json.dump(results, f, indent=2)
    plot(results, os.path.join(OUT, "bench_services.png"))


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(
        ["in-process", "gRPC"],
        [r["in_process_tokens_per_s"], r["grpc_tokens_per_s"]],
        color=["tab:gray", "tab:blue"],
    )
    axes[0].set_title(
        f"one greedy generation ({r['new_tokens']} tokens)\ngRPC / in-process = {r['grpc_over_in_process']}"
    )
    axes[0].set_ylabel("tokens/s")
    axes[1].bar(
        ["cold", "gateway hit"],
        [r["ttft_cold_s"] * 1000, r["ttft_gateway_hit_s"] * 1000],
        color=["tab:gray", "tab:green"],
    )
    axes[1].set_title(f"TTFT at a {r['long_prompt_tokens']}-token prompt ({r['ttft_speedup']}x)")
    axes[1].set_ylabel("ms")
    axes[2].bar(
        ["p50 TTFT", "p99 TTFT"], [r["ttft_p50_s"] * 1000, r["ttft_p99_s"] * 1000], color="tab:orange"
    )
    axes[2].set_title(f"{r['clients']} concurrent clients: {r['aggregate_tokens_per_s']} tok/s aggregate")
    axes[2].set_ylabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
