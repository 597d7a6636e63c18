"""forkline-prefix (also python -m prefix_service --engine ADDR): serve the prefix cache over gRPC.

A separate process from the engine: it owns the prefix cache and its retention policy and holds its
snapshots in the engine under a stable owner id (--owner). At start it releases what an earlier
instance of itself left in the engine. Prints "forkline-prefix listening on HOST:PORT" once it
serves. SIGTERM / SIGINT drain, release every stored snapshot in the engine, and exit.

Auth flags as forkline-engine's (--auth_tokens, --tls_*). To an engine with tokens it sends its own
token (--engine_token_file) for its snapshots and, for calls it makes on a caller's behalf, the
caller's own token, so the engine's token file lists the clients' tokens too.

Budget: the cache holds at most --engine_share of the engine's resident sessions and positions (and
at most --max_entries entries, --max_positions positions), evicting by --policy to stay within it; a
live gateway request that finds the engine full evicts one entry and retries once. Its snapshots in
the engine never expire (the engine's --persistent_owner) and count against the engine's budget for
that owner (--persistent_owner_share); gateway generations run as their caller, in the caller's quota.
"""

from __future__ import annotations

import argparse
import sys


def seconds(text: str) -> float:
    """argparse type: a duration in seconds, >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def share(text: str) -> float:
    """argparse type: a share of the engine, in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from engine_service.rpc.service_main import add_auth_arguments, add_serving_arguments, port_number
    from prefix_service.retention import policy_names

    p = argparse.ArgumentParser(prog="forkline-prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, metavar="HOST:PORT", help="address of the forkline-engine (required)")
    p.add_argument("--max_entries", metavar="N", type=int, default=64,
                   help="stored prompt snapshots at most (also capped by --engine_share); 0 disables storing "
                        "(default: %(default)s)")
    p.add_argument("--max_positions", metavar="N", type=int, default=0,
                   help="positions the stored snapshots may hold together (also capped by --engine_share); "
                        "0: only the share bounds them (default: %(default)s)")
    p.add_argument("--engine_share", metavar="F", type=share, default=0.5,
                   help="share of the engine's resident sessions and positions this service may hold for its "
                        "snapshots, in (0, 1] (default: %(default)s)")
    p.add_argument("--policy", default="lru", choices=policy_names(),
                   help="which entry is evicted when the cache is full (default: %(default)s)")
    p.add_argument("--owner", metavar="OWNER", default="prefix-service",
                   help="owner id of the snapshots in the engine (default: %(default)s)")
    p.add_argument("--engine_timeout", metavar="SECONDS", type=float, default=30.0,
                   help="seconds to wait for the engine at start (default: %(default)s)")
    p.add_argument("--engine_outage_wait", metavar="SECONDS", type=seconds, default=1.0,
                   help="while the engine is down, seconds a call waits for it to come back before "
                        "UNAVAILABLE; 0: fail at once (default: %(default)s)")
    p.add_argument("--engine_token_file", metavar="FILE", default=None,
                   help="file holding this service's bearer token for the engine; the engine's token file "
                        "must map it to --owner (default: none, no token sent)")
    p.add_argument("--engine_tls_ca", metavar="FILE", default=None,
                   help="PEM CA that signed the engine's certificate: connect with TLS (default: none, plaintext)")
    p.add_argument("--engine_tls_cert", metavar="FILE", default=None,
                   help="PEM client certificate for an engine that requires mutual TLS (default: none)")
    p.add_argument("--engine_tls_key", metavar="FILE", default=None,
                   help="PEM private key of --engine_tls_cert (default: none)")
    add_serving_arguments(p, default_port=50052)
    add_auth_arguments(p)
    p.add_argument("--http_port", metavar="PORT", type=port_number, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, ...) on this port of "
                        "--host, in this process, with the same tokens and TLS; 0 picks a free one "
                        "(default: off)")
    p.add_argument("--http_model_name", metavar="NAME", default="",
                   help="the model id HTTP clients send (default: the engine's model file name)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def connect_and_serve(args: argparse.Namespace):
    """Connect to the engine (releasing what an earlier instance left there) and start the gRPC server:
    (PrefixServer, bound port)."""
    from engine_service.auth import read_token_file
    from engine_service.rpc.auth import ClientSecurity
    from engine_service.rpc.service_main import server_security
    from prefix_service.rpc.server import connect_engine, create_server

    security = server_security(args)
    token = read_token_file(args.engine_token_file, "--engine_token_file") if args.engine_token_file else None
    engine_security = ClientSecurity(token, args.engine_tls_ca, args.engine_tls_cert, args.engine_tls_key)
    deps, channel = connect_engine(args.engine, max_entries=args.max_entries, policy=args.policy,
                                   owner=args.owner, ready_timeout=args.engine_timeout,
                                   engine_security=engine_security, outage_wait_s=args.engine_outage_wait,
                                   engine_share=args.engine_share, max_positions=args.max_positions)
    server, port = create_server(deps, f"{args.host}:{args.port}", channel=channel, security=security,
                                 metrics=args.metrics_port is not None)
    if args.http_port is not None:
        start_http(server, args, security.tokens)
    return server, port


def start_http(server, args: argparse.Namespace, tokens) -> None:
    """The OpenAI-compatible HTTP door (--http_port) in this process, over the same gateway, tokens and
    TLS as the gRPC server; prints "forkline-prefix HTTP listening on HOST:PORT"."""
    try:
        port = server.start_http(args.host, args.http_port, model_name=args.http_model_name, auth=tokens,
                                 tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca)
    except BaseException:
        server.stop(0, release=True)  # do not leave the gRPC server running behind a failed start
        raise
    print(f"forkline-prefix HTTP listening on {args.host}:{port}", flush=True)


def main(argv: list[str] | None = None) -> int:
    from engine_service.rpc.service_main import run_service

    # a clean shutdown releases every stored snapshot in the engine (a killed one: its next start)
    return run_service("forkline-prefix", parse_args(argv), connect_and_serve,
                       lambda server, args: server.stop(args.grace, release=True))


if __name__ == "__main__":
    sys.exit(main())
