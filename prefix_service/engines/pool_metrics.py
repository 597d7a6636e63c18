"""The engine pool's Prometheus metrics (``forkline_prefix_dns_*``, ``forkline_prefix_engine_aliases_total``,
``forkline_prefix_engine_departures_total{reason}``), read from :meth:`EnginePool.stats` at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from prefix_service.engines.engine_pool import EnginePool


class PoolCollector:
    """See the module docstring."""

    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool

    def describe(self) -> list[Metric]:
        return []  # names are fixed; no collision check needed at registration

    def collect(self) -> Iterator[Metric]:
        s = self._pool.stats()
        yield CounterMetricFamily(
            "forkline_prefix_dns_failures",
            "Resolutions of --engines that failed or answered nothing",
            value=s.resolve_failures,
        )
        yield GaugeMetricFamily(
            "forkline_prefix_dns_answer_age_seconds", "Age of the DNS answer in use", value=s.answer_age_s
        )
        yield GaugeMetricFamily(
            "forkline_prefix_dns_stale",
            "1 when the last DNS answer is too old to be used",
            value=int(s.stale),
        )
        yield CounterMetricFamily(
            "forkline_prefix_engine_aliases",
            "Addresses that were another address of a known engine",
            value=s.aliases,
        )
        departures = CounterMetricFamily(
            "forkline_prefix_engine_departures", "Engines that left the fleet, by reason", labels=["reason"]
        )
        for reason in ("draining", "unreachable"):
            departures.add_metric([reason], s.departures.get(reason, 0))
        yield departures
