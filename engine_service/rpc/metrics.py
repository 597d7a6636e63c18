"""The engine service's Prometheus metrics, all defined here: the shared RPC ones, three histograms per
forward (engine thread), and engine state read at scrape time. The list: docs/DEPLOY.md (metrics).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from engine_service.serving.rpc_metrics import ServiceMetrics
from engine_service.sessions.engine import EngineSessions
from protos import engine_pb2

GENERATE_METHOD = f"/{engine_pb2.DESCRIPTOR.services_by_name['Engine'].full_name}/Generate"

BATCH_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
BATCH_POSITIONS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
STEP_SECONDS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
)


class EngineMetrics(ServiceMetrics):
    """The engine's metrics over ``deps``; installs itself as the runner's batch observer until
    :meth:`close` (the runner may outlive the server)."""

    def __init__(self, deps: EngineSessions) -> None:
        super().__init__((GENERATE_METHOD,))
        self.batch_rows = Histogram(
            "forkline_engine_batch_rows",
            "Inputs per forward (decode rows + prefill chunks)",
            buckets=BATCH_ROWS,
            registry=self.registry,
        )
        self.batch_positions = Histogram(
            "forkline_engine_batch_positions",
            "Positions fed per forward",
            buckets=BATCH_POSITIONS,
            registry=self.registry,
        )
        self.step = Histogram(
            "forkline_engine_step_seconds",
            "Wall time of one forward (executor.execute)",
            buckets=STEP_SECONDS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(deps))
        self._runner = deps.runner
        self._runner.batch_observer = self.observe_batch

    def observe_batch(self, rows: int, positions: int, seconds: float) -> None:
        """The runner's batch observer (engine thread): three histogram observations."""
        self.batch_rows.observe(rows)
        self.batch_positions.observe(positions)
        self.step.observe(seconds)

    def close(self) -> None:
        if self._runner.batch_observer == self.observe_batch:
            self._runner.batch_observer = None
        super().close()


class EngineCollector:
    """Engine state read at scrape time: ``Runner.metrics()``, the handle registry and the limits."""

    def __init__(self, deps: EngineSessions) -> None:
        self._deps = deps

    def describe(self) -> list[Metric]:
        return []  # names are fixed; no collision check needed at registration

    def collect(self) -> Iterator[Metric]:
        d = self._deps
        m = d.runner.metrics()
        info = InfoMetricFamily("forkline_engine", "The model and cache this engine serves")
        info.add_metric(
            [], {"model": d.model_name, "cache_kind": d.cache_kind, "instance": d.registry.instance_id}
        )
        yield info
        for name, doc, value in (
            (
                "forkline_engine_resident_sessions",
                "Sessions the executor holds now (live, kept, snapshots)",
                m.resident_sessions,
            ),
            (
                "forkline_engine_max_sessions",
                "Resident sessions the executor can hold",
                d.limits.max_sessions,
            ),
            (
                "forkline_engine_max_positions",
                "Positions the K/V of all sessions may hold together (--kv_memory_mib over the bytes per position)",
                d.limits.max_positions,
            ),
            (
                "forkline_engine_kv_bytes_per_position",
                "Bytes one committed position of one session costs (K and V of every layer)",
                d.limits.kv_bytes_per_position,
            ),
            (
                "forkline_engine_held_positions",
                "Positions the session handles hold or reserve now (all owners)",
                d.registry.held_positions(),
            ),
            (
                "forkline_engine_active_generations",
                "Generations the engine thread runs now",
                m.active_generations,
            ),
            (
                "forkline_engine_queued_commands",
                "Commands (starts, opens, clones, closes) waiting for the engine thread",
                m.queued_commands,
            ),
            ("forkline_engine_session_handles", "Session handles registered to clients", len(d.registry)),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("forkline_engine_forward_batches", "Forwards run (failed ones included)", m.forward_batches),
            ("forkline_engine_failed_batches", "Forwards that failed", m.failed_batches),
            ("forkline_engine_decoded_tokens", "Tokens returned to generations", m.tokens_decoded),
            ("forkline_engine_prefill_positions", "Prompt positions prefilled", m.prefill_positions),
            (
                "forkline_engine_generations_started",
                "Generations the engine thread started",
                m.generations_started,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        text = CounterMetricFamily(
            "forkline_engine_text_chars",
            "Characters of text tokenized in long-text pieces, by whether a scope's cache held the piece",
            labels=("result",),
        )
        reused, tokenized = d.tokenizer.piece_counts()
        text.add_metric(["reused"], reused)
        text.add_metric(["tokenized"], tokenized)
        yield text
        clones = CounterMetricFamily(
            "forkline_engine_clones", "Clone requests the engine thread ran, by result", labels=("result",)
        )
        clones.add_metric(["succeeded"], m.clones_succeeded)
        clones.add_metric(["refused"], m.clones_refused)
        yield clones
        drafts = CounterMetricFamily(
            "forkline_engine_draft_tokens",
            "Speculative draft tokens verified (--speculative), by source and result",
            labels=("source", "result"),
        )
        for source, (drafted, accepted) in d.runner.draft_sources.items():
            drafts.add_metric([source, "accepted"], accepted)
            drafts.add_metric([source, "rejected"], drafted - accepted)
        yield drafts
        ratio = d.runner.draft_cost_ratio
        if ratio is not None:
            yield GaugeMetricFamily(
                "forkline_engine_draft_cost_ratio",
                "A forward's fixed cost over one more row's, fitted from the engine's decode steps: "
                "beside B decode rows a draft row pays above B / (ratio + B) acceptance",
                value=ratio,
            )
