"""The ``main`` both services share: the serving and auth flags, metrics on ``--metrics_port``, and
serving until SIGTERM / SIGINT (:func:`run_service`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from engine_service.api.errors import ForklineError
from engine_service.serving.auth import ServerSecurity
from engine_service.serving.grpc_server import GrpcServer
from engine_service.serving.tokens import reload_on_sighup

log = logging.getLogger(__name__)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

S = TypeVar("S", bound=GrpcServer)


def port_number(text: str) -> int:
    """argparse type for ``--port``: 0 (a free port) .. 65535 (grpc binds larger ones modulo 65536)."""
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
    """``--auth_tokens``, ``--tls_cert``, ``--tls_key`` and ``--tls_client_ca``, as both services take them."""
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
    """The flags' :class:`ServerSecurity`; a token table is re-read on SIGHUP (main thread only)."""
    security = ServerSecurity.from_args(args)
    if security.tokens is not None:
        reload_on_sighup(security.tokens)
        logging.getLogger(__name__).info(
            "authentication on: %d tokens from %s", len(security.tokens), security.tokens.path
        )
    return security


def serve_until_signalled(name: str, host: str, port: int) -> None:
    """Print ``<name> listening on HOST:PORT`` (clients read this line), then block until SIGTERM or
    SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"{name} listening on {host}:{port}", flush=True)
    while not stop.wait(1.0):  # timed: a signal caught on another thread runs its handler here within 1 s
        pass


def run_service(
    name: str,
    args: argparse.Namespace,
    start: Callable[[argparse.Namespace], tuple[S, int]],
    stop: Callable[[S, argparse.Namespace], None],
) -> int:
    """A service's ``main`` after parsing: ``start(args)`` the server and its metrics, serve until
    signalled, ``stop(server, args)``; 0, or 2 with one line ``<name>: <problem>`` on stderr."""
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
