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
import random
import statistics
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from clients.engine_client import GenerationStream, Tokens
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.errors import ForklineError
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
from prefix_service.rpc.server import SERVICE_NAME as PREFIX
from prefix_service.rpc.server import create_server as create_prefix_server
from protos import engine_pb2, prefix_pb2

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
MODEL = "smollm2"
PROMPT = "Write a short story about a robot who learns to paint."
SYSTEMS = [
    "You are a patient geography tutor. Answer in two sentences, name the country and one fact about it, "
    "and never use lists. If the question is ambiguous, pick the most common reading and say so briefly.",
    "You are a concise cooking assistant. Give the single most important step first, then one tip that "
    "saves time. Use metric units and keep the whole answer under fifty words.",
    "You are a friendly astronomy guide for children. Use simple words, one comparison to everyday life, "
    "and end with a question that invites the child to look at the night sky.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "How do I boil an egg?",
    "What is a comet?",
    "Where is Mount Kilimanjaro?",
    "How long should pasta cook?",
    "Why does the Moon change shape?",
    "What is the largest desert?",
    "How do I make rice fluffy?",
    "What is a black hole?",
    "Which river is the longest?",
    "How do I keep bread fresh?",
]
WORDS = [
    "Tell",
    "Explain",
    "Describe",
    "Imagine",
    "Compare",
    "Summarize",
    "List",
    "Translate",
    "Recall",
    "Define",
    "Picture",
    "Outline",
    "Sketch",
    "Name",
    "Consider",
    "Suppose",
]


# ----------------------------------------------------------------------------------------- the cost


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


# ------------------------------------------------------------------------------------ the scrapes

Samples = dict[tuple[str, frozenset], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def by_label(samples: Samples, name: str, label: str, **labels: str) -> dict[str, float]:
    want = set(labels.items())
    out: dict[str, float] = defaultdict(float)
    for (n, ls), v in samples.items():
        if n == name and want <= ls:
            out[dict(ls).get(label, "")] += v
    return out


def histogram_quantile(q: float, buckets: dict[str, float]) -> float:
    """Prometheus' histogram_quantile over cumulative bucket counts {le: count} (linear inside a
    bucket; the +Inf bucket answers its lower bound). NaN without observations."""
    bounds = sorted((math.inf if le == "+Inf" else float(le), c) for le, c in buckets.items())
    if not bounds or bounds[-1][1] <= 0:
        return math.nan
    rank = q * bounds[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in bounds:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def rate(a: Samples, b: Samples, seconds: float, name: str, **labels: str) -> float:
    return (total(b, name, **labels) - total(a, name, **labels)) / seconds


def quantile_over(a: Samples, b: Samples, q: float, name: str, **labels: str) -> float:
    before, after = by_label(a, name, "le", **labels), by_label(b, name, "le", **labels)
    return histogram_quantile(q, {le: after[le] - before.get(le, 0.0) for le in after})


def panels(series: list[tuple[float, Samples, Samples]], window: int) -> dict[str, list]:
    """The dashboard's panels over the scrapes, each point a rate over ``window`` scrapes."""
    out: dict[str, list] = defaultdict(list)
    for k in range(window, len(series)):
        (t0, e0, p0), (t1, e1, p1) = series[k - window], series[k]
        dt = t1 - t0
        out["t"].append(t1 - series[0][0])
        hits, misses = (
            rate(p0, p1, dt, "forkline_prefix_hits_total"),
            rate(p0, p1, dt, "forkline_prefix_misses_total"),
        )
        out["hit_rate"].append(hits / (hits + misses) if hits + misses else math.nan)
        prompt = rate(e0, e1, dt, "forkline_prompt_tokens_total", service=ENGINE)
        reused = rate(e0, e1, dt, "forkline_reused_positions_total", service=ENGINE)
        out["reused_share"].append(reused / prompt if prompt else math.nan)
        for q in (0.5, 0.99):
            for svc, key in ((ENGINE, "engine"), (PREFIX, "gateway")):
                samples = (e0, e1) if svc == ENGINE else (p0, p1)
                out[f"ttft_{key}_p{round(q * 100)}"].append(
                    quantile_over(*samples, q, "forkline_time_to_first_token_seconds_bucket", service=svc)
                )
            out[f"itl_p{round(q * 100)}"].append(
                quantile_over(e0, e1, q, "forkline_inter_token_latency_seconds_bucket", service=ENGINE)
            )
        out["step_p50"].append(quantile_over(e0, e1, 0.5, "forkline_engine_step_seconds_bucket"))
        out["generated_tps"].append(rate(e0, e1, dt, "forkline_generated_tokens_total", service=ENGINE))
        out["prefill_tps"].append(rate(e0, e1, dt, "forkline_engine_prefill_positions_total"))
        for gauge in ("forkline_engine_resident_sessions", "forkline_engine_active_generations"):
            out[gauge].append(total(e1, gauge))
        out["forkline_prefix_entries"].append(total(p1, "forkline_prefix_entries"))
        codes = defaultdict(float)
        for (n, ls), v in p1.items():
            if n == "forkline_rpc_requests_total":
                labels = dict(ls)
                before = p0.get((n, ls), 0.0)
                codes[f"{labels['method']} {labels['code']}"] += (v - before) / dt
        out["codes"].append(dict(codes))
    return out


# ------------------------------------------------------------------------------------ the traffic


def traffic(prefix_address: str, seconds: float, clients: int, seed: int) -> dict[str, int]:
    """Mixed gateway traffic from ``clients`` threads for ``seconds``; returns what was sent."""
    sent: dict[str, int] = defaultdict(int)
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(i: int) -> None:
        rng = random.Random(seed + i)
        prefix = PrefixClient(prefix_address, owner=f"client-{i}")
        while time.monotonic() < deadline:
            r = rng.random()
            question = rng.choice(QUESTIONS)
            new_tokens = rng.choice([8, 16, 24, 32])
            try:
                if r < 0.06:
                    kind = "invalid"
                    # sent as is: the client's GenConfig refuses max_new_tokens 0, the gateway must too
                    zero = engine_pb2.GenerationConfig(max_new_tokens=0)
                    request = prefix_pb2.GatewayGenerateRequest(
                        text=engine_pb2.TextInput(text=question, chat=True, add_special_tokens=True),
                        config=zero,
                    )
                    GenerationStream(prefix.stub.Generate(request, metadata=prefix._metadata)).collect()
                elif r < 0.3:
                    kind = "raw"
                    prefix.generate(
                        text=f"{rng.choice(WORDS)} {rng.randrange(10**6)}: {question}",
                        config=GenConfig(max_new_tokens=new_tokens, temperature=0.0),
                    ).collect()
                else:
                    kind = "chat"
                    prefix.generate(
                        text=question,
                        system=rng.choice(SYSTEMS),
                        chat=True,
                        config=GenConfig(max_new_tokens=new_tokens, temperature=0.0),
                    ).collect()
            except ForklineError:
                pass
            with lock:
                sent[kind] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(sent)


def scrape_while(busy: Callable[[], bool], ports: tuple[int, int], every: float) -> list:
    series = []
    while True:
        series.append((time.monotonic(), scrape(ports[0]), scrape(ports[1])))
        if not busy():
            return series
        time.sleep(every)


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


def plot(view: dict[str, list], r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = view["t"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    ax = axes[0][0]
    ax.plot(t, view["hit_rate"], label="lookup hit rate")
    ax.plot(t, view["reused_share"], label="prompt tokens reused")
    ax.set_ylim(0, 1.05)
    ax.set_title("Prefix cache hit rate")
    ax = axes[0][1]
    for key, style in (("engine", "-"), ("gateway", "--")):
        ax.plot(t, [x * 1000 for x in view[f"ttft_{key}_p50"]], style, color="tab:blue", label=f"p50 {key}")
        ax.plot(t, [x * 1000 for x in view[f"ttft_{key}_p99"]], style, color="tab:red", label=f"p99 {key}")
    ax.set_ylabel("ms")
    ax.set_title("Time to first token")
    ax = axes[0][2]
    ax.plot(t, view["generated_tps"], label="generated")
    ax.plot(t, view["prefill_tps"], label="prefilled")
    ax.set_ylabel("tokens/s")
    ax.set_title("Tokens/s (engine)")
    ax = axes[1][0]
    ax.plot(t, view["forkline_engine_resident_sessions"], label="resident sessions")
    ax.plot(t, view["forkline_engine_active_generations"], label="active generations")
    ax.plot(t, view["forkline_prefix_entries"], label="prefix entries")
    ax.set_title("Sessions")
    ax = axes[1][1]
    names = sorted({k for point in view["codes"] for k in point if not k.startswith("Check")})
    for name in names:
        ax.plot(t, [point.get(name, 0.0) for point in view["codes"]], label=name)
    ax.set_ylabel("requests/s")
    ax.set_title("Prefix service requests by method and code")
    ax = axes[1][2]
    ax.plot(t, [x * 1000 for x in view["itl_p50"]], label="inter-token p50")
    ax.plot(t, [x * 1000 for x in view["itl_p99"]], label="inter-token p99")
    ax.plot(t, [x * 1000 for x in view["step_p50"]], label="forward step p50")
    ax.set_ylabel("ms")
    ax.set_title("Decode latency")
    for row in axes:
        for ax in row:
            ax.set_xlabel("s")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    cost = r["decode_tokens_per_s_1_streams"]["on_over_off"]
    fig.suptitle(
        f"forkline metrics from /metrics scrapes: {r['model']}, {r['traffic']['clients']} clients of mixed "
        f"gateway traffic, rates over {r['traffic']['window_s']:.0f} s windows "
        f"(metrics on/off decode tokens/s, one stream: {cost})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
