"""The engine flags of forkline-prefix: where the engines are (addresses, DNS) and how this service
connects to them (owner id, timeouts, token, TLS)."""

from __future__ import annotations

import argparse

from engine_service.api.owners import PERSISTENT_OWNER
from engine_service.serving.auth import ClientSecurity
from engine_service.serving.tokens import read_token_file


def seconds(text: str) -> float:
    """argparse type: a duration in seconds, >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a duration in seconds, > 0."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        action="append",
        metavar="HOST:PORT",
        help="address of a forkline-engine; repeat it for several (default: none; this or --engines is required)",
    )
    p.add_argument(
        "--engines",
        metavar="dns:///NAME:PORT",
        default=None,
        help="every A / AAAA address NAME resolves to may be an engine (a Kubernetes headless Service: "
        "one per ready pod; an engine is its instance id, however many addresses it has), re-resolved "
        "every --resolve_every seconds; dns://SERVER:PORT/NAME:PORT asks that DNS server (default: none)",
    )
    p.add_argument(
        "--resolve_every",
        metavar="SECONDS",
        type=positive_seconds,
        default=5.0,
        help="seconds between resolutions of --engines: new engines join (default: %(default)s)",
    )
    p.add_argument(
        "--dns_stale_after",
        metavar="SECONDS",
        type=positive_seconds,
        default=300.0,
        help="a failed or empty resolution of --engines keeps the last answer this long; engines "
        "that joined stay regardless (default: %(default)s)",
    )
    p.add_argument(
        "--engine_leave_after",
        metavar="SECONDS",
        type=positive_seconds,
        default=60.0,
        help="an engine that stays unreachable or NOT_SERVING this long leaves (its entries dropped); "
        "a draining engine (SIGTERM) leaves once its streams ended (default: %(default)s)",
    )


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--owner",
        metavar="OWNER",
        default=PERSISTENT_OWNER,
        help="owner id of the snapshots in the engine (default: %(default)s)",
    )
    p.add_argument(
        "--engine_timeout",
        metavar="SECONDS",
        type=float,
        default=30.0,
        help="seconds to wait for the engine at start (default: %(default)s)",
    )
    p.add_argument(
        "--engine_outage_wait",
        metavar="SECONDS",
        type=seconds,
        default=1.0,
        help="while the engine is down, seconds a call waits for it to come back before "
        "UNAVAILABLE; 0: fail at once (default: %(default)s)",
    )
    p.add_argument(
        "--engine_token_file",
        metavar="FILE",
        default=None,
        help="file holding this service's bearer token for the engine; the engine's token file "
        "must map it to --owner (default: none, no token sent)",
    )
    p.add_argument(
        "--engine_tls_ca",
        metavar="FILE",
        default=None,
        help="PEM CA that signed the engine's certificate: connect with TLS (default: none, plaintext)",
    )
    p.add_argument(
        "--engine_tls_cert",
        metavar="FILE",
        default=None,
        help="PEM client certificate for an engine that requires mutual TLS (default: none)",
    )
    p.add_argument(
        "--engine_tls_key",
        metavar="FILE",
        default=None,
        help="PEM private key of --engine_tls_cert (default: none)",
    )


def engine_security(args: argparse.Namespace) -> ClientSecurity:
    """This service's token for the engines and TLS to them."""
    token = read_token_file(args.engine_token_file, "--engine_token_file") if args.engine_token_file else None
    return ClientSecurity(token, args.engine_tls_ca, args.engine_tls_cert, args.engine_tls_key)
