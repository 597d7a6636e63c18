"""forkline-prefix (python -m prefix_service): the prefix cache service; the flag groups live with the
rooms that own them (``*/flags.py``), this module assembles them and serves."""

from __future__ import annotations

import argparse
import sys

from prefix_service.gateway.flags import tenancy

DESCRIPTION = """forkline-prefix (also python -m prefix_service --engine ADDR): serve the prefix cache over gRPC.

Engines: --engine HOST:PORT, repeated for several, and/or --engines dns:///NAME:PORT (every address
the name resolves to, re-resolved every --resolve_every seconds). Each engine has its own snapshots
and budget; each request goes to the engine --routing picks (cache_aware: where the longest stored
prefix is, unless that engine is overloaded), and to the next one when that engine is down or full
before the first token.

A separate process from the engine: it owns the prefix cache and its retention policy and holds its
snapshots in the engine under a stable owner id (--owner). At start it releases what an earlier
instance of itself left in the engine. Prints "forkline-prefix listening on HOST:PORT" once it
serves. SIGTERM / SIGINT drain, release every stored snapshot in the engine, and exit.

Auth flags as forkline-engine's (--auth_tokens, --tls_*). To an engine with tokens it sends its own
token (--engine_token_file) for its snapshots and, for calls it makes on a caller's behalf, the
caller's own token, so the engine's token file lists the clients' tokens too. With tokens a namespace
belongs to its caller's owner (--shared_namespace NAME: every caller's); Stats / Clear cover the
caller's own namespaces, everything for --admin_owner (docs/SECURITY.md#tenancy-in-the-prefix-service).

Budget: the cache holds at most --engine_share of the engine's resident sessions and of the positions
its K/V memory holds (and at most --max_cache_mib MiB at the engine's bytes per position, --max_entries
entries, --max_positions positions), evicting by --policy to stay within it; a
live gateway request that finds the engine full evicts one entry and retries once. Its snapshots in
the engine never expire (the engine's --persistent_owner) and count against the engine's budget for
that owner (--persistent_owner_share); gateway generations run as their caller, in the caller's quota.

Sliding-window models on batched-sequence: a captured prompt also keeps checkpoints (message ends and
branch points, at most --max_checkpoints; --checkpoint_stride adds stride points), so a prompt
diverging there reuses an exact prefix instead of a `window` miss (prefix_service/cache/checkpoints.py).

A generation also stores its session at its last committed token (the prompt and the answer), so a
follow-up chat turn reuses the answer's positions up to the first id its template renders differently
(--no-cache_generated: prompts only).
"""


def build_parser() -> argparse.ArgumentParser:
    from engine_service.serving.service_main import add_auth_arguments, add_serving_arguments
    from prefix_service.cache.flags import add_cache_arguments
    from prefix_service.engines.flags import add_connection_arguments, add_target_arguments
    from prefix_service.fleet.flags import add_routing_arguments
    from prefix_service.gateway.flags import (
        add_generation_arguments,
        add_join_arguments,
        add_tenancy_arguments,
    )
    from prefix_service.http.flags import add_http_arguments
    from prefix_service.tier.flags import add_tier_arguments

    p = argparse.ArgumentParser(
        prog="forkline-prefix", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_target_arguments(p)
    add_routing_arguments(p)
    add_cache_arguments(p)
    add_generation_arguments(p)
    add_connection_arguments(p)
    add_tier_arguments(p)
    add_serving_arguments(p, default_port=50052)
    add_auth_arguments(p)
    add_tenancy_arguments(p)
    add_join_arguments(p)
    add_http_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from prefix_service.cache.flags import check_cache_arguments
    from prefix_service.fleet.flags import check_routing_arguments
    from prefix_service.gateway.flags import check_join_arguments
    from prefix_service.tier.flags import check_tier_arguments

    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.engine and not args.engines:
        parser.error("one of --engine HOST:PORT or --engines dns:///NAME:PORT is required")
    check_tier_arguments(parser, args)
    check_cache_arguments(parser, args)
    check_routing_arguments(parser, args)
    check_join_arguments(parser, args)
    return args


def connect_and_serve(args: argparse.Namespace):
    """Connect to the engines (releasing what an earlier instance left there) and start the gRPC
    server: (PrefixServer, bound port)."""
    from engine_service.serving.service_main import server_security
    from prefix_service.cache.flags import checkpoints_from
    from prefix_service.engines.connect import connect_fleet
    from prefix_service.engines.engine_targets import engine_targets
    from prefix_service.engines.flags import engine_security
    from prefix_service.fleet.flags import routing_from
    from prefix_service.gateway.flags import joins_from
    from prefix_service.rpc.server import create_server
    from prefix_service.tier.flags import tier_from

    security = server_security(args)
    tier = tier_from(args)
    fleet, pool = connect_fleet(
        engine_targets(args.engine, args.engines, stale_after_s=args.dns_stale_after),
        policy=routing_from(args),
        tier=tier,
        ready_timeout=args.engine_timeout,
        resolve_every_s=args.resolve_every,
        leave_after_s=args.engine_leave_after,
        max_entries=args.max_entries,
        policy_name=args.policy,
        owner=args.owner,
        engine_security=engine_security(args),
        outage_wait_s=args.engine_outage_wait,
        engine_share=args.engine_share,
        max_positions=args.max_positions,
        max_cache_mib=args.max_cache_mib,
        checkpoints=checkpoints_from(args),
        cache_generated=args.cache_generated,
        checkpoint_every=args.resume_checkpoint_tokens,
        joins=joins_from(args),
    )
    fleet.max_resumes = args.max_resumes
    try:
        server, port = create_server(
            fleet,
            f"{args.host}:{args.port}",
            pool=pool,
            security=security,
            metrics=args.metrics_port is not None,
            tenancy=tenancy(args),
        )
    except BaseException:
        pool.stop()
        for member in fleet.members():
            member.close()
        if tier is not None:
            tier.stop()
        raise
    if args.http_port is not None:
        start_http(server, args, security.tokens)
    return server, port


def start_http(server, args: argparse.Namespace, tokens) -> None:
    """The OpenAI-compatible HTTP door (--http_port) in this process, over the same gateway, tokens and
    TLS as the gRPC server; prints "forkline-prefix HTTP listening on HOST:PORT"."""
    try:
        port = server.start_http(
            args.host,
            args.http_port,
            model_name=args.http_model_name,
            auth=tokens,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            namespace=args.http_namespace or "",
        )
    except BaseException:
        server.stop(0, release=True)  # do not leave the gRPC server running behind a failed start
        raise
    print(f"forkline-prefix HTTP listening on {args.host}:{port}", flush=True)


def main(argv: list[str] | None = None) -> int:
    from engine_service.serving.service_main import run_service

    # a clean shutdown releases every stored snapshot in the engine (a killed one: its next start)
    return run_service(
        "forkline-prefix",
        parse_args(argv),
        connect_and_serve,
        lambda server, args: server.stop(args.grace, release=True),
    )


if __name__ == "__main__":
    sys.exit(main())
