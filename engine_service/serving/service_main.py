"""What both services (``forkline-engine``, ``forkline-prefix``) share: the serving and auth flags, a
gRPC server with health checking, reflection and optional TLS / bearer tokens, draining it once,
Prometheus metrics on ``--metrics_port``, and serving until SIGTERM / SIGINT.

:func:`build_grpc_server` binds and starts one service; :class:`GrpcServer` is the base of both
servers' handles (``stop`` drains once, then stops the metrics endpoint); :func:`run_service` is the
body of both ``main``s.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_service.api.errors import FailedPrecondition, ForklineError
from engine_service.serving.auth import ServerSecurity
from engine_service.serving.rpc_metrics import ServiceMetrics
from engine_service.serving.tokens import is_loopback, reload_on_sighup

log = logging.getLogger(__name__)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

S = TypeVar("S", bound="GrpcServer")


def port_number(text: str) -> int:
    """argparse type for ``--port``: 0 (pick a free port) .. 65535. grpc would bind a larger number
    modulo 65536, i.e. on a port nobody asked for."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


def add_serving_arguments(parser: argparse.ArgumentParser, *, default_port: int) -> None:
    """``--host``, ``--port``, ``--grace`` and ``--log_level``, as both services take them."""
    parser.add_argument(
        "--host", metavar="HOST", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    parser.add_argument(
        "--port",
        metavar="PORT",
        type=port_number,
        default=default_port,
        help="port to listen on; 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--grace",
        metavar="SECONDS",
        type=float,
        default=5.0,
        help="seconds the calls in flight get to finish at shutdown (default: %(default)s)",
    )
    parser.add_argument(
        "--log_level",
        default="INFO",
        type=str.upper,
        choices=LOG_LEVELS,
        help="log messages at this level and above on stderr (default: %(default)s)",
    )
    parser.add_argument(
        "--metrics_port",
        metavar="PORT",
        type=port_number,
        default=None,
        help="serve Prometheus metrics on http://HOST:PORT/metrics (plain HTTP, no token: keep it "
        "on a private network); 0 picks a free one (default: off)",
    )


def add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    """``--auth_tokens``, ``--tls_cert``, ``--tls_key`` and ``--tls_client_ca``, as both services take
    them (read by ``rpc.auth.ServerSecurity.from_args``)."""
    parser.add_argument(
        "--auth_tokens",
        metavar="FILE",
        default=None,
        help="token file, one 'token owner' pair a line ('#' comments); every call but health "
        "and reflection needs 'authorization: Bearer <token>' and runs as the token's "
        "owner; re-read on SIGHUP (default: none, owners are self-declared)",
    )
    parser.add_argument(
        "--tls_cert",
        metavar="FILE",
        default=None,
        help="PEM server certificate (chain); serve TLS with --tls_key (default: none, plaintext)",
    )
    parser.add_argument(
        "--tls_key", metavar="FILE", default=None, help="PEM private key of --tls_cert (default: none)"
    )
    parser.add_argument(
        "--tls_client_ca",
        metavar="FILE",
        default=None,
        help="PEM CA certificate(s): require client certificates signed by it, i.e. mutual TLS "
        "(default: none, no client certificate asked)",
    )


def server_security(args: argparse.Namespace) -> ServerSecurity:
    """The :class:`ServerSecurity` the flags of :func:`add_auth_arguments` ask for; a token table is
    re-read on SIGHUP (installs the handler: call from the main thread)."""
    security = ServerSecurity.from_args(args)
    if security.tokens is not None:
        reload_on_sighup(security.tokens)
        logging.getLogger(__name__).info(
            "authentication on: %d tokens from %s", len(security.tokens), security.tokens.path
        )
    return security


def build_grpc_server(
    add_servicer: Callable[[Any, grpc.Server], None],
    servicer: Any,
    service_name: str,
    address: str,
    *,
    max_workers: int,
    thread_name_prefix: str,
    security: ServerSecurity | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """A started server for ``servicer`` (registered with its generated ``add_servicer``), gRPC health
    checking (SERVING for "" and ``service_name``) and reflection; returns it, its health servicer and
    the bound port. ``address`` ``host:0`` picks a free port; OSError when it cannot be bound.
    ``security``: TLS credentials and/or the token interceptor (None: plaintext, owners self-declared;
    a warning is logged when such a server listens on a non-loopback address). ``interceptors`` run
    before the security ones (the metrics interceptor, which also counts refused calls)."""
    security = security or ServerSecurity()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix),
        options=[("grpc.so_reuseport", 0)],
        interceptors=(*interceptors, *security.interceptors()),
    )
    add_servicer(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", service_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if security.credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, security.credentials)
    if port == 0:
        raise OSError(f"could not bind {address}")
    host = address.rsplit(":", 1)[0]
    if not security.authenticates and not is_loopback(host):
        log.warning(
            "%s listens on %s without authentication: anyone who can reach it can act as any owner "
            "(see --auth_tokens)",
            service_name,
            address,
        )
    server.start()
    return server, health_servicer, port


class GrpcServer:
    """A running service built by :func:`build_grpc_server`. ``port`` is the bound port. ``metrics``:
    its Prometheus metrics when built with them (their interceptor installed), else None."""

    metrics: ServiceMetrics | None = None

    def __init__(
        self, server: grpc.Server, servicer: Any, health_servicer: health.HealthServicer, port: int
    ) -> None:
        self.grpc_server = server
        self.servicer = servicer
        self.health = health_servicer
        self.port = port
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def _drain(
        self, grace: float | None, *, after: Callable[[], None], before: Callable[[], None] | None = None
    ) -> None:
        """Once: ``before``, health NOT_SERVING, stop the server (calls in flight get ``grace``
        seconds, then are cancelled), ``after``. Later calls return at once."""
        with self._lock:
            if self._stopped.is_set():
                return
            if before is not None:
                before()
            self.health.enter_graceful_shutdown()
            self.grpc_server.stop(grace).wait()
            after()
            if self.metrics is not None:
                self.metrics.close()
            self._stopped.set()

    def start_metrics(self, host: str, port: int) -> int:
        """Serve this server's metrics on ``http://host:port/metrics`` (0: a free port) until it stops;
        returns the bound port. FailedPrecondition when it was built without metrics."""
        if self.metrics is None:
            raise FailedPrecondition(
                "this server was created without metrics (create_server(..., metrics=True))"
            )
        return self.metrics.serve(host, port)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)


def serve_until_signalled(name: str, host: str, port: int) -> None:
    """Print ``<name> listening on HOST:PORT`` (clients and the demo read this line), then block until
    SIGTERM or SIGINT arrives. The caller drains its server afterwards."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"{name} listening on {host}:{port}", flush=True)
    stop.wait()


def run_service(
    name: str,
    args: argparse.Namespace,
    start: Callable[[argparse.Namespace], tuple[S, int]],
    stop: Callable[[S, argparse.Namespace], None],
) -> int:
    """A service's ``main`` after parsing (``args`` from :func:`add_serving_arguments`): configure
    logging, ``start(args)`` the server (built with metrics when ``--metrics_port`` is set) and its
    metrics endpoint (printing ``<name> metrics on http://HOST:PORT/metrics``); a ForklineError or
    OSError prints one line ``<name>: <problem>`` on stderr and returns 2. Then serve until signalled,
    ``stop(server, args)``, return 0."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server, port = start(args)
    except (ForklineError, OSError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port is not None:
        try:
            metrics_port = server.start_metrics(args.host, args.metrics_port)
        except (ForklineError, OSError) as exc:
            print(f"{name}: metrics: {exc}", file=sys.stderr)
            stop(server, args)
            return 2
        print(f"{name} metrics on http://{args.host}:{metrics_port}/metrics", flush=True)
    serve_until_signalled(name, args.host, port)
    logging.getLogger(name).info("draining (grace %.1f s)", args.grace)
    stop(server, args)
    return 0
