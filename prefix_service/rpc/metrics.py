"""The prefix service's Prometheus metrics, all defined here.

- RPCs and gateway generation streams (``engine_service.rpc.rpc_metrics.RpcMetrics``, label
  ``service="forkline.prefix.v1.PrefixCache"``): requests by method and code, their duration, TTFT,
  inter-token and end-to-end latency, prompt / reused / generated tokens of gateway ``Generate`` calls.
- The cache, read from ``Gateway.stats()`` at scrape time (:class:`GatewayCollector`; every path
  counts: gRPC Lookup / Insert / Generate and the HTTP door alike): ``forkline_prefix_hits_total``,
  ``forkline_prefix_misses_total``, ``forkline_prefix_reused_tokens_total`` (positions hits reused),
  ``forkline_prefix_inserts_total``, ``forkline_prefix_refusals_total{reason}`` (inserts and clones
  turned down),
  ``forkline_prefix_evictions_total``, ``forkline_prefix_entries`` / ``_max_entries``,
  ``forkline_prefix_positions`` / ``_max_positions``, entries dropped on engine restarts, pressure
  evictions and retries.

One engine today: per-engine labels come with routing to several.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from engine_service.rpc.rpc_metrics import ServiceMetrics
from prefix_service.gateway import Gateway
from protos import prefix_pb2

GENERATE_METHOD = f"/{prefix_pb2.DESCRIPTOR.services_by_name['PrefixCache'].full_name}/Generate"


class PrefixMetrics(ServiceMetrics):
    """The prefix service's metrics over ``gateway``."""

    def __init__(self, gateway: Gateway) -> None:
        super().__init__((GENERATE_METHOD,))
        self.registry.register(GatewayCollector(gateway))


class GatewayCollector:
    """Prefix-cache state read at scrape time from ``Gateway.stats()`` (one lock acquisition)."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def describe(self) -> list[Metric]:
        return []  # names are fixed; no collision check needed at registration

    def collect(self) -> Iterator[Metric]:
        s = self._gateway.stats()
        c = s.cache
        info = InfoMetricFamily("forkline_prefix", "The retention policy and the engine instance served")
        info.add_metric([], {"policy": s.policy, "engine_instance": s.engine_instance_id})
        yield info
        for name, doc, value in (
            ("forkline_prefix_entries", "Stored prompt snapshots", c.entries),
            ("forkline_prefix_max_entries", "Stored snapshots at most (0: storing disabled)", c.max_entries),
            ("forkline_prefix_positions", "Positions the stored snapshots hold", c.positions),
            ("forkline_prefix_max_positions", "Positions the snapshots may hold (0: unbounded)", c.max_positions),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("forkline_prefix_hits", "Lookups that returned a snapshot clone", c.hits),
            ("forkline_prefix_misses", "Lookups that returned none", c.misses),
            ("forkline_prefix_reused_tokens", "Prompt positions hits reused", c.reused_tokens),
            ("forkline_prefix_inserts", "Snapshots stored", c.inserts),
            ("forkline_prefix_evictions", "Entries the retention policy evicted", c.evictions),
            ("forkline_prefix_dropped_on_restart", "Entries dropped because the engine restarted",
             s.dropped_on_restart),
            ("forkline_prefix_pressure_evictions", "Entries evicted to make room for a live request",
             s.pressure_evictions),
            ("forkline_prefix_pressure_retries", "Live requests retried after such an eviction", s.pressure_retries),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        refusals = CounterMetricFamily("forkline_prefix_refusals", "Inserts and clones the cache turned down, "
                                       "by reason (as StatsResponse.refusals)", labels=("reason",))
        for reason, count in sorted(c.refusals.items()):
            refusals.add_metric([str(reason)], count)
        yield refusals
