"""What both services' Prometheus metrics share: the RPC and generation-stream metrics, the interceptor
that feeds them, and the ``/metrics`` endpoint; one registry per server. Spec: docs/DEPLOY.md (metrics).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server
from prometheus_client.process_collector import ProcessCollector

from engine_service.serving.auth import rebuild_handler

log = logging.getLogger(__name__)

# Fixed buckets (upper bounds, seconds). TTFT spans a cached hit on a tiny model (ms) to a cold
# 2,000-token prefill on two CPU cores (~10 s); inter-token latency one decode step of one to many
# sequences; end-to-end a whole generation.
RPC_SECONDS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
TTFT_SECONDS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
)
ITL_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)

OK = grpc.StatusCode.OK.name


class RpcMetrics:
    """Requests by RPC and status code, duration and in flight; for ``GenerateEvent`` streams
    (``generate_methods``): time to first token, inter-token latency, latency, tokens, finish reasons."""

    def __init__(self, registry: CollectorRegistry, generate_methods: Iterable[str] = ()) -> None:
        self.generate_methods = frozenset(generate_methods)
        rpc = ("service", "method")
        self.requests = Counter(
            "forkline_rpc_requests_total",
            "RPCs handled, by method and status code",
            (*rpc, "code"),
            registry=registry,
        )
        self.duration = Histogram(
            "forkline_rpc_duration_seconds",
            "RPC handling time (streams: until the last message)",
            rpc,
            buckets=RPC_SECONDS,
            registry=registry,
        )
        self.in_flight = Gauge("forkline_rpc_in_flight", "RPCs being handled now", rpc, registry=registry)
        gen = ("service",)
        self.ttft = Histogram(
            "forkline_time_to_first_token_seconds",
            "From a Generate call's arrival to its first token",
            gen,
            buckets=TTFT_SECONDS,
            registry=registry,
        )
        self.itl = Histogram(
            "forkline_inter_token_latency_seconds",
            "Between consecutive token events of a generation",
            gen,
            buckets=ITL_SECONDS,
            registry=registry,
        )
        self.e2e = Histogram(
            "forkline_e2e_request_latency_seconds",
            "From a Generate call's arrival to its done event",
            gen,
            buckets=E2E_SECONDS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "forkline_prompt_tokens_total",
            "Prompt positions of generations (reused + prefilled)",
            gen,
            registry=registry,
        )
        self.reused_positions = Counter(
            "forkline_reused_positions_total",
            "Prompt positions generations reused instead of prefilling them",
            gen,
            registry=registry,
        )
        self.generated_tokens = Counter(
            "forkline_generated_tokens_total", "Tokens generations streamed", gen, registry=registry
        )
        self.finished = Counter(
            "forkline_generations_finished_total",
            "Generations that sent their done event, by finish reason",
            (*gen, "finish_reason"),
            registry=registry,
        )


class _Method:
    """One RPC method's labelled children, resolved once (``labels`` takes a lock)."""

    def __init__(self, metrics: RpcMetrics, full_name: str) -> None:
        service, _, name = full_name.lstrip("/").rpartition("/")
        self.requests = metrics.requests
        self.labels = (service, name)
        self.duration = metrics.duration.labels(service, name)
        self.in_flight = metrics.in_flight.labels(service, name)
        self._codes: dict[str, Any] = {}
        self.generation: _GenerationMetrics | None = None
        if full_name in metrics.generate_methods:
            self.generation = _GenerationMetrics(metrics, service)

    def done(self, started: float, code: str) -> None:
        self.in_flight.dec()
        self.duration.observe(time.perf_counter() - started)
        child = self._codes.get(code)
        if child is None:
            child = self._codes.setdefault(code, self.requests.labels(*self.labels, code))
        child.inc()


class _GenerationMetrics:
    def __init__(self, metrics: RpcMetrics, service: str) -> None:
        self.ttft = metrics.ttft.labels(service)
        self.itl = metrics.itl.labels(service)
        self.e2e = metrics.e2e.labels(service)
        self.prompt_tokens = metrics.prompt_tokens.labels(service)
        self.reused_positions = metrics.reused_positions.labels(service)
        self.generated_tokens = metrics.generated_tokens.labels(service)
        self._finished = metrics.finished
        self._service = service
        self._reasons: dict[str, Any] = {}

    def watch(self, events: Iterator[Any], started: float) -> Iterator[Any]:
        """Yield ``events`` (``GenerateEvent`` messages) unchanged, observing them on the way."""
        last = 0.0
        for event in events:
            kind = event.WhichOneof("event")
            if kind == "tokens":
                count = len(event.tokens.ids)
                if count:
                    now = time.perf_counter()
                    if last:
                        self.itl.observe(now - last)
                    else:
                        self.ttft.observe(now - started)
                    last = now
                    self.generated_tokens.inc(count)
            elif kind == "started":
                self.reused_positions.inc(event.started.position)
                self.prompt_tokens.inc(event.started.position + event.started.input_positions)
            elif kind == "done":
                self.e2e.observe(time.perf_counter() - started)
                self._reason(event.done.finish_reason).inc()
            yield event

    def _reason(self, reason: str) -> Any:
        child = self._reasons.get(reason)
        if child is None:
            child = self._reasons.setdefault(reason, self._finished.labels(self._service, reason))
        return child


def _ended_code(context: grpc.ServicerContext, failed: bool) -> str:
    """The handler's status, else UNKNOWN (an exception escaped), CANCELLED / DEADLINE_EXCEEDED (the
    call went away) or OK."""
    code = context.code()
    if code is not None:
        return code.name
    if failed:
        return grpc.StatusCode.UNKNOWN.name
    if not context.is_active():
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        return (grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED).name
    return OK


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times every call to a served method by status, and watches generation streams.
    Install it outermost, so calls the token interceptor refuses count as UNAUTHENTICATED."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self.metrics = metrics
        self._methods: dict[str, _Method] = {}
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED; not a label value we keep
            return None
        name = handler_call_details.method
        method = self._methods.get(name)
        if method is None:
            with self._lock:
                method = self._methods.setdefault(name, _Method(self.metrics, name))
        return rebuild_handler(
            handler, lambda behaviour, streams: (_streaming if streams else _unary)(method, behaviour)
        )


def _unary(method: _Method, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    def run(request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        method.in_flight.inc()
        failed = True
        try:
            response = behaviour(request, context)
            failed = False
            return response
        finally:
            method.done(started, _ended_code(context, failed))

    return run


def _streaming(method: _Method, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        started = time.perf_counter()
        method.in_flight.inc()
        failed = True
        responses = None
        try:
            responses = behaviour(request, context)
            watched = responses if method.generation is None else method.generation.watch(responses, started)
            yield from watched
            failed = False
        except GeneratorExit:  # grpc closed the stream: the client went away (or the server stopped)
            failed = False
            raise
        finally:
            close = getattr(responses, "close", None)
            if close is not None:
                close()
            method.done(started, _ended_code(context, failed))

    return run


class MetricsEndpoint:
    """``http://host:port/metrics`` from a daemon thread; ``port`` 0 picks one (``self.port``)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._httpd, self._thread = start_http_server(port, host, registry)
        self.host = host
        self.port: int = self._httpd.server_port

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


class ServiceMetrics:
    """A service's registry (``process_*`` included), RPC metrics and interceptor; subclasses add
    their metrics and collectors to ``self.registry``."""

    def __init__(self, generate_methods: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry()
        self.rpc = RpcMetrics(self.registry, generate_methods)
        self.interceptor = MetricsInterceptor(self.rpc)
        ProcessCollector(registry=self.registry)
        self.endpoint: MetricsEndpoint | None = None

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port); returns the bound port."""
        if self.endpoint is None:
            self.endpoint = MetricsEndpoint(self.registry, host, port)
            log.info("metrics on http://%s:%d/metrics", host, self.endpoint.port)
        return self.endpoint.port

    def close(self) -> None:
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            endpoint.stop()
