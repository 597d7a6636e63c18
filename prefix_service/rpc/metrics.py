"""The prefix service's Prometheus metrics: RPCs and gateway streams (``serving.rpc_metrics``), the cache
and each engine read from ``Fleet.stats()`` at scrape time, the snapshot directory. Names: docs/DEPLOY.md#metrics."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from engine_service.serving.rpc_metrics import ServiceMetrics
from prefix_service.fleet.fleet import Fleet
from prefix_service.fleet.stats import FleetStats
from prefix_service.tier.snapshot_store import StoreStats
from protos import prefix_pb2

GENERATE_METHOD = f"/{prefix_pb2.DESCRIPTOR.services_by_name['PrefixCache'].full_name}/Generate"


class PrefixMetrics(ServiceMetrics):
    """The prefix service's metrics over ``fleet``."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__((GENERATE_METHOD,))
        self.registry.register(GatewayCollector(fleet))


class GatewayCollector:
    """Prefix-cache state read at scrape time from ``Fleet.stats()``."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def describe(self) -> list[Metric]:
        return []  # names are fixed; no collision check needed at registration

    def collect(self) -> Iterator[Metric]:
        fleet = self._fleet.stats()
        s = fleet.total
        c = s.cache
        info = InfoMetricFamily(
            "forkline_prefix", "The retention and routing policies and the (first) engine instance served"
        )
        info.add_metric(
            [], {"policy": s.policy, "engine_instance": s.engine_instance_id, "routing": fleet.routing}
        )
        yield info
        for name, doc, value in (
            ("forkline_prefix_entries", "Stored prompt snapshots", c.entries),
            ("forkline_prefix_max_entries", "Stored snapshots at most (0: storing disabled)", c.max_entries),
            ("forkline_prefix_positions", "Positions the stored snapshots hold", c.positions),
            (
                "forkline_prefix_radix_positions",
                "Positions an ideal radix tree of the stored keys holds",
                c.radix_positions,
            ),
            (
                "forkline_prefix_max_positions",
                "Positions the snapshots may hold (0: unbounded)",
                c.max_positions,
            ),
            (
                "forkline_prefix_bytes",
                "K/V bytes the stored snapshots hold (at the engine's bytes per position)",
                c.bytes_held,
            ),
            (
                "forkline_prefix_max_bytes",
                "K/V bytes the snapshots may hold (0: unbounded or not reported)",
                c.max_bytes,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("forkline_prefix_hits", "Lookups that returned a snapshot clone", c.hits),
            ("forkline_prefix_reused_tokens", "Prompt positions hits reused", c.reused_tokens),
            ("forkline_prefix_inserts", "Snapshots stored", c.inserts),
            ("forkline_prefix_evictions", "Entries the retention policy evicted", c.evictions),
            (
                "forkline_prefix_dropped_on_restart",
                "Entries dropped because the engine restarted",
                s.dropped_on_restart,
            ),
            (
                "forkline_prefix_pressure_evictions",
                "Entries evicted to make room for a live request",
                s.pressure_evictions,
            ),
            (
                "forkline_prefix_pressure_retries",
                "Live requests retried after such an eviction",
                s.pressure_retries,
            ),
            (
                "forkline_prefix_joins",
                "Requests that waited for a prefix in flight and reused it",
                s.joins.joins,
            ),
            ("forkline_prefix_join_timeouts", "Waits for a prefix in flight that gave up", s.joins.timeouts),
            (
                "forkline_prefix_join_wait_seconds",
                "Seconds requests waited for prefixes in flight",
                s.joins.wait_s,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        misses = CounterMetricFamily(
            "forkline_prefix_misses",
            "Lookups that returned none, by the reason reported (LookupResponse.reason)",
            labels=("reason",),
        )
        for reason, count in sorted(s.misses_by_reason.items()):
            misses.add_metric([reason], count)
        yield misses
        refusals = CounterMetricFamily(
            "forkline_prefix_refusals",
            "Inserts and clones the cache turned down, by reason (as StatsResponse.refusals)",
            labels=("reason",),
        )
        for reason, count in sorted(c.refusals.items()):
            refusals.add_metric([str(reason)], count)
        yield refusals
        yield from _engine_metrics(fleet)
        if fleet.snapshot_dir is not None:
            yield from _snapshot_dir_metrics(fleet.snapshot_dir)


def _snapshot_dir_metrics(d: StoreStats) -> Iterator[Metric]:
    """The snapshot directory (--snapshot_dir): files, bytes and what happened to them."""
    yield GaugeMetricFamily(
        "forkline_prefix_snapshot_files", "Snapshot files in the directory", value=d.files
    )
    yield GaugeMetricFamily("forkline_prefix_snapshot_bytes", "Bytes the snapshot files hold", value=d.bytes)
    yield GaugeMetricFamily(
        "forkline_prefix_snapshot_max_bytes", "The directory's byte budget", value=d.max_bytes
    )
    events = CounterMetricFamily(
        "forkline_prefix_snapshot_events",
        "Snapshot files written, dropped (queue "
        "full), failed, restored into an engine, refused by one, evicted, discarded",
        labels=("event",),
    )
    for event in ("written", "dropped", "failed", "restored", "refused", "evicted", "discarded"):
        events.add_metric([event], getattr(d, event))
    yield events


def _engine_metrics(fleet: FleetStats) -> Iterator[Metric]:
    """Each engine's share, labelled by its name; route decisions by reason."""
    label = ("engine",)
    for name, doc, kind, value in (
        (
            "forkline_prefix_engine_routable",
            "1 while requests are routed to the engine",
            GaugeMetricFamily,
            lambda e: int(e.routable),
        ),
        (
            "forkline_prefix_engine_entries",
            "Snapshots stored in the engine",
            GaugeMetricFamily,
            lambda e: e.stats.cache.entries,
        ),
        (
            "forkline_prefix_engine_positions",
            "Positions those snapshots hold",
            GaugeMetricFamily,
            lambda e: e.stats.cache.positions,
        ),
        (
            "forkline_prefix_engine_in_flight",
            "Gateway generations this service runs there",
            GaugeMetricFamily,
            lambda e: e.in_flight,
        ),
        (
            "forkline_prefix_engine_load",
            "Generations running or queued there (all callers, as last read)",
            GaugeMetricFamily,
            lambda e: e.load,
        ),
        (
            "forkline_prefix_engine_hits",
            "Lookups served from the engine's snapshots",
            CounterMetricFamily,
            lambda e: e.stats.cache.hits,
        ),
        (
            "forkline_prefix_engine_misses",
            "Lookups routed to the engine that found nothing",
            CounterMetricFamily,
            lambda e: e.stats.cache.misses,
        ),
        (
            "forkline_prefix_engine_routed",
            "Requests routed to the engine",
            CounterMetricFamily,
            lambda e: e.routed,
        ),
        (
            "forkline_prefix_engine_load_guarded",
            "Requests sent elsewhere because the engine was overloaded",
            CounterMetricFamily,
            lambda e: e.load_guarded,
        ),
    ):
        family = kind(name, doc, labels=label)
        for engine in fleet.engines:
            family.add_metric([engine.name], value(engine))
        yield family
    routes = CounterMetricFamily(
        "forkline_prefix_routes",
        "Route decisions by reason (cache, miss, load_guard, load, turn)",
        labels=("reason",),
    )
    for reason, count in sorted(fleet.routes.items()):
        routes.add_metric([reason], count)
    yield routes
