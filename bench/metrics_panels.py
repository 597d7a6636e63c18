"""What bench_metrics measures from /metrics: scrapes, and the dashboard's panels computed from them as
Prometheus would (rates over a window, histogram_quantile with linear interpolation inside buckets),
plotted like deploy/grafana/forkline-dashboard.json."""

from __future__ import annotations

import math
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from engine_service.rpc.server import SERVICE_NAME as ENGINE
from prefix_service.rpc.server import SERVICE_NAME as PREFIX

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


def scrape_while(busy: Callable[[], bool], ports: tuple[int, int], every: float) -> list:
    series = []
    while True:
        series.append((time.monotonic(), scrape(ports[0]), scrape(ports[1])))
        if not busy():
            return series
        time.sleep(every)


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
