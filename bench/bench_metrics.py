"""Metrics benchmark on the real model (SmolLM2-135M-Instruct): what Prometheus metrics cost, and what
they show under traffic.

1. Cost: one engine thread (one Runner) behind three engine servers, one built with metrics (interceptor
   + the runner's batch observer, attached only while it is measured) and two without, each with its
   own prefix service (with / without metrics). --rounds rounds of the same gateway generations (all
   prefix hits, greedy, --new-tokens tokens, 1 and --clients concurrent streams) through each, the
   order rotating. Decode tokens/s is timed by the caller from each stream's first to last token; a
   ratio is the median over rounds of back-to-back runs. The two unmetered pairs are the A/A control:
   off2 / off shows how far a ratio moves with nothing changed. Target: metrics on >= 0.98 x off. Also
   the hot-path code alone (the stream watch per token event, the batch observer per forward), timed
   in a loop: its share of a decode step is the cost that noise cannot hide.
2. Dashboard: --duration seconds of mixed traffic (chat prompts sharing system prompts, raw prompts that
   mostly miss, a few invalid requests) from --traffic-clients threads through the metered prefix
   service, both /metrics endpoints scraped every --scrape-every seconds; panels like
   deploy/grafana/forkline-dashboard.json (hit rate, TTFT p50/p99, tokens/s, sessions, requests by code,
   inter-token latency and step time) computed from the scrapes as Prometheus would (rates over a
   window, histogram_quantile with linear interpolation inside buckets).

Prints one JSON object, writes bench/out/bench_metrics.json and bench/out/bench_metrics.png.
Usage: .venv/bin/python bench/bench_metrics.py [--rounds 12] [--new-tokens 48] [--clients 4] [--duration 90]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from collections import defaultdict

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from clients.engine_client import Tokens
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.owners import NO_QUOTA
from engine_service.executors.options import ExecutorSettings
from engine_service.model.loading.loader import load_model
from engine_service.rpc.metrics import EngineMetrics
from engine_service.rpc.server import SERVICE_NAME as ENGINE
from engine_service.rpc.server import create_server
from engine_service.serving.rpc_metrics import MetricsInterceptor
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import SessionSettings
from prefix_service.engines.connect import connect_engine
from prefix_service.rpc.server import create_server as create_prefix_server
from protos import engine_pb2

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # its sibling modules (metrics_*), also when loaded by path
from metrics_panels import panels, plot, quantile_over, scrape_while, total  # noqa: E402
from metrics_traffic import traffic  # noqa: E402

OUT = os.path.join(HERE, "out")

MODEL = "smollm2"

PROMPT = "Write a short story about a robot who learns to paint."


def stream_decode(prefix: PrefixClient, prompt: str, new_tokens: int) -> tuple[int, float]:
    """(decoded tokens after the first, seconds from the first to the last token) of one generation."""
    first_at = last_at = 0.0
    first_count = count = 0
    for event in prefix.generate(
        text=prompt, chat=True, config=GenConfig(max_new_tokens=new_tokens, temperature=0.0), ignore_eos=True
    ):
        if isinstance(event, Tokens) and event.ids:
            now = time.perf_counter()
            if not count:
                first_at, first_count = now, len(event.ids)
            last_at = now
            count += len(event.ids)
    return count - first_count, last_at - first_at


def decode_rate(prefixes: list[PrefixClient], prompts: list[str], new_tokens: int) -> float:
    """Aggregate decode tokens/s of one generation per client, all started together."""
    results: list[tuple[int, float]] = [(0, 0.0)] * len(prefixes)
    barrier = threading.Barrier(len(prefixes))

    def client(i: int) -> None:
        barrier.wait()
        results[i] = stream_decode(prefixes[i], prompts[i], new_tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prefixes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(n / s for n, s in results)


def median_ratio(on: list[float], off: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(on, off, strict=True))


class _Context:
    """The bits of a grpc.ServicerContext the metrics interceptor reads, for timing it alone."""

    def code(self):
        return None

    def is_active(self) -> bool:
        return True

    def time_remaining(self):
        return None


def hot_path_costs(deps: EngineSessions, events: int = 20000) -> dict:
    """Microseconds per streamed token event through the interceptor's Generate wrapper (vs the bare
    stream) and per forward in the batch observer, on throwaway metrics (call before serving ``deps``)."""
    import grpc

    engine_metrics = EngineMetrics(deps)
    engine_metrics.close()  # only timed here: detached from the runner at once
    stream = [engine_pb2.GenerateEvent(tokens=engine_pb2.TokensEvent(ids=[42], text="a"))] * events
    handler = grpc.unary_stream_rpc_method_handler(lambda request, context: iter(stream))
    details = type("Details", (), {"method": f"/{ENGINE}/Generate", "invocation_metadata": ()})()
    interceptor = MetricsInterceptor(engine_metrics.rpc)
    wrapped = interceptor.intercept_service(lambda _details: handler, details)
    best_plain = best_watched = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _event in handler.unary_stream(None, _Context()):
            pass
        t1 = time.perf_counter()
        for _event in wrapped.unary_stream(None, _Context()):
            pass
        t2 = time.perf_counter()
        best_plain, best_watched = min(best_plain, t1 - t0), min(best_watched, t2 - t1)
    t0 = time.perf_counter()
    for _ in range(events):
        engine_metrics.observe_batch(4, 4, 0.05)
    observer_s = time.perf_counter() - t0
    return {
        "watch_us_per_token_event": round((best_watched - best_plain) / events * 1e6, 2),
        "batch_observer_us_per_forward": round(observer_s / events * 1e6, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--duration", type=float, default=90.0)
    p.add_argument("--traffic-clients", type=int, default=3)
    p.add_argument("--scrape-every", type=float, default=2.0)
    p.add_argument("--window", type=int, default=5, help="scrapes per rate window")
    args = p.parse_args()

    loaded = load_model()
    modes = ("on", "off", "off2")  # off2: a second unmetered pair, the A/A control (how noisy is a ratio?)
    deps = EngineSessions.build(
        loaded,
        loaded.tokenizer,
        model_name=MODEL,
        chat=loaded.chat,
        executor=ExecutorSettings(
            max_sessions=48,
            max_session_tokens=1024,
            max_decode_sequences=max(args.clients, args.traffic_clients),
        ),
        sessions=SessionSettings(
            idle_timeout_s=0.0,
            persistent_owners=tuple(f"prefix-{mode}" for mode in modes),
            quota=NO_QUOTA,
            persistent_quota=NO_QUOTA,
        ),
    )
    costs = hot_path_costs(deps)
    servers: dict[str, tuple] = {}  # mode -> (engine server, prefix server, prefix port); kept referenced
    observer = None
    for mode in modes:
        engine, engine_port = create_server(deps, "127.0.0.1:0", metrics=mode == "on")
        if mode == "on":
            observer = deps.runner.batch_observer  # the metered server's; the others run with None
        gateway, channel = connect_engine(f"127.0.0.1:{engine_port}", max_entries=12, owner=f"prefix-{mode}")
        prefix, prefix_port = create_prefix_server(
            gateway, "127.0.0.1:0", channel=channel, metrics=mode == "on"
        )
        servers[mode] = (engine, prefix, prefix_port)
    results: dict = {
        "model": os.path.basename(loaded.path),
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
    }
    try:
        # 1. the cost, metrics on vs off (each prompt stored first: every measured call is a hit)
        prompts = [f"{PROMPT} Variant {i}." for i in range(args.clients)]
        clients = {
            mode: [PrefixClient(f"127.0.0.1:{port}", owner=f"bench-{i}") for i in range(args.clients)]
            for mode, (_, _, port) in servers.items()
        }
        for mode in modes:
            for i in range(args.clients):
                stream_decode(clients[mode][i], prompts[i], 2)
        rates: dict[tuple[str, int], list[float]] = defaultdict(list)
        for r in range(args.rounds):
            for streams in (1, args.clients):
                for mode in modes[r % 3 :] + modes[: r % 3]:  # the order rotates
                    deps.runner.batch_observer = observer if mode == "on" else None
                    rates[mode, streams].append(
                        decode_rate(clients[mode][:streams], prompts[:streams], args.new_tokens)
                    )
        deps.runner.batch_observer = observer
        for streams in (1, args.clients):
            on, off, off2 = (rates[mode, streams] for mode in modes)
            results[f"decode_tokens_per_s_{streams}_streams"] = {
                "on": round(statistics.median(on), 2),
                "off": round(statistics.median(off), 2),
                "on_over_off": round(median_ratio(on, off), 4),
                "off2_over_off": round(median_ratio(off2, off), 4),  # the A/A control: the noise
                "runs_on": [round(x, 2) for x in on],
                "runs_off": [round(x, 2) for x in off],
                "runs_off2": [round(x, 2) for x in off2],
            }
        results |= costs
        one = results["decode_tokens_per_s_1_streams"]["off"]
        # what the hot path adds per token of one stream: one watched event on each service + one forward
        per_token_us = 2 * results["watch_us_per_token_event"] + results["batch_observer_us_per_forward"]
        results["estimated_cost_one_stream"] = round(per_token_us * 1e-6 * one, 5)

        # 2. the dashboard's panels under mixed traffic through the metered services (the unmetered
        # prefix services release their snapshots first: the engine then holds only the traffic's)
        for mode in ("off", "off2"):
            servers[mode][1].stop(0, release=True)
        engine_on, prefix_on, prefix_on_port = servers["on"]
        ports = (engine_on.start_metrics("127.0.0.1", 0), prefix_on.start_metrics("127.0.0.1", 0))
        done = threading.Event()
        sent: dict = {}
        worker = threading.Thread(
            target=lambda: (
                sent.update(traffic(f"127.0.0.1:{prefix_on_port}", args.duration, args.traffic_clients, 7)),
                done.set(),
            )
        )
        worker.start()
        series = scrape_while(lambda: not done.is_set(), ports, args.scrape_every)
        worker.join()
        results["traffic"] = {
            "seconds": args.duration,
            "clients": args.traffic_clients,
            "sent": sent,
            "scrapes": len(series),
            "window_s": args.window * args.scrape_every,
        }
        view = panels(series, args.window)
        last_e, last_p = series[-1][1], series[-1][2]
        results["traffic"] |= {
            "prefix_hits": total(last_p, "forkline_prefix_hits_total"),
            "prefix_misses": total(last_p, "forkline_prefix_misses_total"),
            "ttft_engine_p50_s": round(
                quantile_over(
                    series[0][1], last_e, 0.5, "forkline_time_to_first_token_seconds_bucket", service=ENGINE
                ),
                4,
            ),
            "ttft_engine_p99_s": round(
                quantile_over(
                    series[0][1], last_e, 0.99, "forkline_time_to_first_token_seconds_bucket", service=ENGINE
                ),
                4,
            ),
        }
    finally:
        for _, prefix, _ in servers.values():
            prefix.stop(0)
        for engine, _, _ in servers.values():
            engine.stop(0)
        deps.runner.shutdown()

    print(json.dumps(results, indent=2))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "bench_metrics.json"), "w") as f:
        json.dump(results, f, indent=2)
    plot(view, results, os.path.join(OUT, "bench_metrics.png"))


if __name__ == "__main__":
    main()
