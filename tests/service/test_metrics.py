"""Prometheus metrics on both services: real servers with metrics on, scraped over HTTP during and
after traffic, parsed with prometheus_client's own text parser. Counters move by exactly the traffic
sent; an RPC never called has no series (the negative control)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.engine_client import EngineClient, Tokens
from clients.prefix_client import PrefixClient
from engine_service.__main__ import parse_args as engine_args
from engine_service.api import errors
from engine_service.api.config import GenConfig
from engine_service.executors.options import ExecutorSettings
from engine_service.model.random_init import random_model
from engine_service.model.text.chat import ChatFormatter
from engine_service.rpc.server import SERVICE_NAME as ENGINE
from engine_service.rpc.server import create_server
from engine_service.serving.service_main import run_service
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED
from prefix_service.engines.connect import connect_engine
from prefix_service.rpc.server import SERVICE_NAME as PREFIX
from prefix_service.rpc.server import create_server as create_prefix_server
from tests.service.conftest import Engine, Prefix, char_tokenizer
from tests.service.helpers import PROMPT, wait_for

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "forkline-dashboard.json"
NEW_TOKENS = 5
FIXED = {
    "config": GenConfig(max_new_tokens=NEW_TOKENS, temperature=10.0, seed=7),
    "ignore_eos": True,
}  # 5 tokens


def engine_deps() -> EngineSessions:
    return EngineSessions.build(
        random_model("FRFR", 4, 0),
        char_tokenizer(),
        model_name="tiny-FRFR-seed0",
        chat=ChatFormatter(name="chatml"),
        executor=ExecutorSettings(
            cache_kind="batched-sequence", max_sessions=8, max_session_tokens=256, prefill_chunk=64
        ),
        sessions=UNLIMITED,
    )


@pytest.fixture
def services() -> Iterator[tuple[Engine, Prefix]]:
    server, port = create_server(engine_deps(), "127.0.0.1:0", metrics=True)
    engine = Engine(server, port)
    gateway, channel = connect_engine(engine.address, max_entries=16, cache_generated=False)  # counts prompts
    prefix = Prefix(*create_prefix_server(gateway, "127.0.0.1:0", channel=channel, metrics=True))
    try:
        yield engine, prefix
    finally:
        prefix.stop(0, release=False)
        engine.stop(0)


class Scrape:
    """One scrape of ``/metrics``: ``value(name, **labels)`` sums the matching samples (0.0: none)."""

    def __init__(self, port: int) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
            text = reply.read().decode()
        families = list(text_string_to_metric_families(text))
        self.samples = [s for family in families for s in family.samples]
        # every name a query may use: families (also those without samples yet) and their series
        self.names = (
            {s.name for s in self.samples}
            | {f.name for f in families}
            | {f"{f.name}_total" for f in families if f.type == "counter"}
        )

    def value(self, name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def has(self, name: str, **labels: str) -> bool:
        return any(
            s.name == name and all(s.labels.get(k) == v for k, v in labels.items()) for s in self.samples
        )


def dashboard_metrics() -> set[str]:
    """The metric names the Grafana dashboard's queries use."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {
        name
        for panel in panels
        for target in panel["targets"]
        for name in re.findall(r"\bforkline_[a-z0-9_]+", target["expr"])
    }


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def test_counters_move_with_the_traffic_on_both_services(services) -> None:
    engine, prefix = services
    e_port = engine.server.start_metrics("127.0.0.1", 0)
    p_port = prefix.server.start_metrics("127.0.0.1", 0)
    e0, p0 = Scrape(e_port), Scrape(p_port)
    client = EngineClient(engine.address, owner="alice")
    gateway = PrefixClient(prefix.address, owner="alice")

    # During a generation: one Generate in flight on the engine, its engine state visible.
    stream = client.generate(
        PROMPT, config=GenConfig(max_new_tokens=200, temperature=10.0, seed=7), ignore_eos=True
    )
    events = iter(stream)
    assert any(isinstance(event, Tokens) and event.ids for event in events)  # first tokens arrived
    during = Scrape(e_port)
    assert during.value("forkline_rpc_in_flight", service=ENGINE, method="Generate") == 1
    assert during.value("forkline_engine_active_generations") == 1
    assert delta(e0, during, "forkline_time_to_first_token_seconds_count", service=ENGINE) == 1
    stream.cancel()
    assert wait_for(
        lambda: Scrape(e_port).value("forkline_rpc_in_flight", service=ENGINE, method="Generate") == 0
    )
    e1 = Scrape(e_port)
    assert (
        delta(e0, e1, "forkline_rpc_requests_total", service=ENGINE, method="Generate", code="CANCELLED") == 1
    )
    with pytest.raises(errors.NotFound):  # an error's status code is its label
        client.close("0123456789abcdef.00000000000000000000000000000000")
    assert (
        delta(
            e1,
            Scrape(e_port),
            "forkline_rpc_requests_total",
            service=ENGINE,
            method="Close",
            code="NOT_FOUND",
        )
        == 1
    )

    direct = [client.generate(PROMPT, **FIXED).collect() for _ in range(3)]
    rounds = [gateway.generate(PROMPT, **FIXED).collect() for _ in range(2)]  # a miss, then a hit
    assert [r.done.reused_positions for r in rounds] == [0, len(PROMPT) - 1]
    e2, p2 = Scrape(e_port), Scrape(p_port)

    # Engine: every Generate (direct and the gateway's), by code; tokens and prompt positions exactly.
    generations = direct + rounds
    assert delta(e1, e2, "forkline_rpc_requests_total", service=ENGINE, method="Generate", code="OK") == 5
    assert delta(e1, e2, "forkline_rpc_duration_seconds_count", service=ENGINE, method="Generate") == 5
    assert delta(e1, e2, "forkline_generated_tokens_total", service=ENGINE) == 5 * NEW_TOKENS
    assert delta(e1, e2, "forkline_generations_finished_total", service=ENGINE, finish_reason="length") == 5
    assert delta(e1, e2, "forkline_prompt_tokens_total", service=ENGINE) == 5 * len(PROMPT)
    assert delta(e1, e2, "forkline_reused_positions_total", service=ENGINE) == len(PROMPT) - 1
    assert delta(e1, e2, "forkline_time_to_first_token_seconds_count", service=ENGINE) == 5
    assert delta(e1, e2, "forkline_e2e_request_latency_seconds_count", service=ENGINE) == 5
    token_events = sum(sum(1 for ev in g.events if isinstance(ev, Tokens) and ev.ids) for g in generations)
    assert delta(e1, e2, "forkline_inter_token_latency_seconds_count", service=ENGINE) == token_events - 5
    # Engine thread: one step observation per forward, and the runner's own counters agree.
    forwards = delta(e1, e2, "forkline_engine_forward_batches_total")
    assert forwards >= NEW_TOKENS and delta(e1, e2, "forkline_engine_step_seconds_count") == forwards
    assert delta(e1, e2, "forkline_engine_batch_rows_count") == forwards
    prefilled = 4 * len(PROMPT) + 1  # the gateway's hit prefills only the final prompt token
    assert delta(e1, e2, "forkline_engine_prefill_positions_total") == prefilled
    assert delta(e1, e2, "forkline_engine_decoded_tokens_total") == 5 * NEW_TOKENS
    # fed positions: the prompts, then each token but the last of every generation
    assert delta(e1, e2, "forkline_engine_batch_positions_sum") == prefilled + 5 * (NEW_TOKENS - 1)
    assert (
        e2.value("forkline_engine_resident_sessions") == engine.runner.resident_sessions == 1
    )  # the snapshot
    assert e2.value("forkline_engine_max_sessions") == 8
    assert e2.value("forkline_engine_max_positions") == 8 * 256  # the slots bind: memory is ample
    assert e2.value("forkline_engine_kv_bytes_per_position") == engine.deps.limits.kv_bytes_per_position > 0
    assert e2.value("forkline_engine_held_positions") == engine.deps.registry.held_positions() > 0
    assert e2.has("forkline_engine_info", cache_kind="batched-sequence", model="tiny-FRFR-seed0")

    # Prefix service: gateway Generates by code, their tokens, and the cache as Stats reports it.
    assert delta(p0, p2, "forkline_rpc_requests_total", service=PREFIX, method="Generate", code="OK") == 2
    assert delta(p0, p2, "forkline_generated_tokens_total", service=PREFIX) == 2 * NEW_TOKENS
    assert delta(p0, p2, "forkline_reused_positions_total", service=PREFIX) == len(PROMPT) - 1
    assert delta(p0, p2, "forkline_time_to_first_token_seconds_count", service=PREFIX) == 2
    stats = gateway.stats()  # a Stats RPC: counted too, after this scrape
    assert (
        (p2.value("forkline_prefix_hits_total"), p2.value("forkline_prefix_misses_total"))
        == (stats.hits, stats.misses)
        == (1, 1)
    )
    assert p2.value("forkline_prefix_entries") == stats.entries == 1
    assert p2.value("forkline_prefix_inserts_total") == stats.inserts == 1
    assert p2.value("forkline_prefix_reused_tokens_total") == stats.reused_positions == len(PROMPT) - 1
    assert p2.value("forkline_prefix_evictions_total") == 0
    # per engine (one here): labelled with its address, agreeing with the totals
    assert p2.value("forkline_prefix_engine_entries", engine=engine.address) == 1
    assert p2.value("forkline_prefix_engine_routable", engine=engine.address) == 1
    assert delta(p0, p2, "forkline_prefix_engine_routed_total", engine=engine.address) == 2
    assert p2.value("forkline_prefix_engine_hits_total", engine=engine.address) == stats.hits
    p3 = Scrape(p_port)
    assert delta(p2, p3, "forkline_rpc_requests_total", service=PREFIX, method="Stats", code="OK") == 1

    # Negative control: RPCs nobody called have no series at all.
    assert p3.has("forkline_rpc_requests_total", method="Generate")
    assert not p3.has("forkline_rpc_requests_total", method="Clear")
    assert not e2.has("forkline_rpc_requests_total", method="Detokenize")
    assert p3.value("forkline_rpc_requests_total", method="Clear") == 0

    # The Grafana dashboard queries only metrics the two services export (a renamed metric fails here).
    used, exported = dashboard_metrics(), e2.names | p3.names
    assert len(used) >= 15 and used <= exported, used - exported
    assert "forkline_prefix_hits_total" in used and "forkline_prefix_hit_total" not in exported


def test_prefix_misses_follow_lookups(services) -> None:
    _, prefix = services
    port = prefix.server.start_metrics("127.0.0.1", 0)
    before = Scrape(port)
    alice = PrefixClient(prefix.address, owner="alice")
    assert [alice.lookup(PROMPT).reason for _ in range(3)] == ["empty"] * 3
    after = Scrape(port)
    assert delta(before, after, "forkline_prefix_misses_total") == 3
    assert delta(before, after, "forkline_prefix_misses_total", reason="empty") == 3  # by the reason reported
    assert delta(before, after, "forkline_prefix_misses_total", reason="diverged") == 0
    assert prefix.server.fleet.stats().total.misses_by_reason["empty"] >= 3
    assert alice.lookup([1]).reason == "too_short"
    assert delta(before, Scrape(port), "forkline_prefix_misses_total", reason="too_short") == 1
    assert delta(before, after, "forkline_prefix_hits_total") == 0
    assert delta(before, after, "forkline_rpc_requests_total", method="Lookup", code="OK") == 3


def test_the_endpoint_stops_with_the_server() -> None:
    server, _ = create_server(engine_deps(), "127.0.0.1:0", metrics=True)
    try:
        port = server.start_metrics("127.0.0.1", 0)
        assert Scrape(port).has("forkline_engine_resident_sessions")
        assert server.deps.runner.batch_observer is not None
    finally:
        server.stop(0, shutdown_runner=True)
    with pytest.raises(urllib.error.URLError):
        Scrape(port)
    assert server.deps.runner.batch_observer is None


def test_a_server_without_metrics_has_no_interceptor_and_no_endpoint() -> None:
    server, _ = create_server(engine_deps(), "127.0.0.1:0")
    try:
        assert server.metrics is None and server.deps.runner.batch_observer is None
        with pytest.raises(errors.FailedPrecondition):
            server.start_metrics("127.0.0.1", 0)
    finally:
        server.stop(0, shutdown_runner=True)


def test_metrics_port_flag_serves_until_the_service_stops(capsys) -> None:
    """run_service (both mains' body) with --metrics_port 0: the endpoint's line is printed, it serves,
    and SIGTERM drains the server and stops the endpoint."""
    args = engine_args(["--port", "0", "--metrics_port", "0", "--log_level", "WARNING"])
    started: list = []

    def start(a):
        server, port = create_server(engine_deps(), f"{a.host}:{a.port}", metrics=a.metrics_port is not None)
        started.append(server)
        return server, port

    scraped: list[tuple[int, Scrape]] = []

    def scrape_then_terminate() -> None:
        try:
            assert wait_for(lambda: bool(started) and started[0].metrics.endpoint is not None)
            port = started[0].metrics.endpoint.port
            scraped.append((port, Scrape(port)))
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    threading.Thread(target=scrape_then_terminate, daemon=True).start()
    try:
        code = run_service(
            "forkline-engine", args, start, lambda server, a: server.stop(0, shutdown_runner=True)
        )
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert code == 0 and scraped
    port, scrape = scraped[0]
    assert scrape.has("forkline_engine_resident_sessions")
    assert f"forkline-engine metrics on http://127.0.0.1:{port}/metrics" in capsys.readouterr().out
    with pytest.raises(urllib.error.URLError):
        Scrape(port)
