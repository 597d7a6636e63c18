"""forkline-prefix (also python -m prefix_service --engine ADDR): serve the prefix cache over gRPC.

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
caller's own namespaces, everything for --admin_owner (README "Authentication").

Budget: the cache holds at most --engine_share of the engine's resident sessions and positions (and
at most --max_entries entries, --max_positions positions), evicting by --policy to stay within it; a
live gateway request that finds the engine full evicts one entry and retries once. Its snapshots in
the engine never expire (the engine's --persistent_owner) and count against the engine's budget for
that owner (--persistent_owner_share); gateway generations run as their caller, in the caller's quota.

Sliding-window models on batched-sequence: a captured prompt also keeps checkpoints (--checkpoint_stride,
message ends, at most --max_checkpoints), so a prompt diverging inside a stored one reuses an exact
prefix instead of a `window` miss (prefix_service/cache/checkpoints.py).
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


def positive_seconds(text: str) -> float:
    """argparse type: a duration in seconds, > 0."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
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
    from engine_service.api.owners import PERSISTENT_OWNER
    from engine_service.serving.service_main import add_auth_arguments, add_serving_arguments, port_number
    from prefix_service.cache.checkpoints import DEFAULT_CHECKPOINT_STRIDE, DEFAULT_MAX_CHECKPOINTS
    from prefix_service.cache.retention import policy_names
    from prefix_service.fleet.cost_model import DEFAULT_MIN_REUSE_FRACTION, DEFAULT_MIN_REUSE_POSITIONS
    from prefix_service.fleet.routing import (
        DEFAULT_IMBALANCE_ABS,
        DEFAULT_IMBALANCE_REL,
        DEFAULT_ROUTING,
        routing_names,
    )

    p = argparse.ArgumentParser(
        prog="forkline-prefix", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    p.add_argument(
        "--routing",
        default=DEFAULT_ROUTING,
        choices=routing_names(),
        help="which engine serves a request: cost (the lowest expected time to first token: positions "
        "to compute x measured prefill rate + queue, see docs/DEPLOY.md Routing), cache_aware (the most "
        "reused positions unless overloaded), least_loaded, round_robin (default: %(default)s)",
    )
    p.add_argument(
        "--route_min_reuse_fraction",
        metavar="F",
        type=float,
        default=DEFAULT_MIN_REUSE_FRACTION,
        help="cost: a reuse shorter than this share of the prompt does not decide, in [0, 1] "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--route_min_reuse_positions",
        metavar="N",
        type=int,
        default=DEFAULT_MIN_REUSE_POSITIONS,
        help="cost: nor one shorter than N positions, e.g. a chat template's header (default: %(default)s)",
    )
    p.add_argument(
        "--route_moves",
        choices=("on", "off"),
        default="on",
        help="cost: copy a loaded or draining engine's snapshot to the engine chosen when that is cheaper "
        "than recomputing it there (measured; docs/DEPLOY.md Moves) (default: %(default)s)",
    )
    p.add_argument(
        "--route_imbalance_abs",
        metavar="N",
        type=int,
        default=DEFAULT_IMBALANCE_ABS,
        help="cache_aware: the best-matching engine is overloaded when its load exceeds the least "
        "loaded engine's by more than N requests and --route_imbalance_rel times "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--route_imbalance_rel",
        metavar="F",
        type=float,
        default=DEFAULT_IMBALANCE_REL,
        help="cache_aware: the factor of that guard, >= 1 (default: %(default)s)",
    )
    p.add_argument(
        "--max_entries",
        metavar="N",
        type=int,
        default=64,
        help="stored prompt snapshots at most (also capped by --engine_share); 0 disables storing "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--max_positions",
        metavar="N",
        type=int,
        default=0,
        help="positions the stored snapshots may hold together (also capped by --engine_share); "
        "0: only the share bounds them (default: %(default)s)",
    )
    p.add_argument(
        "--engine_share",
        metavar="F",
        type=share,
        default=0.5,
        help="share of the engine's resident sessions and positions this service may hold for its "
        "snapshots, in (0, 1] (default: %(default)s)",
    )
    p.add_argument(
        "--policy",
        default="lru",
        choices=policy_names(),
        help="which entry is evicted when the cache is full (default: %(default)s)",
    )
    p.add_argument(
        "--checkpoint_stride",
        metavar="N",
        type=int,
        default=DEFAULT_CHECKPOINT_STRIDE,
        help="on an engine whose cache evicts sliding-window rows (batched-sequence with sliding "
        "layers), a captured prompt also keeps a snapshot every N positions and at the end of each "
        "chat message, so a prompt diverging inside it reuses an exact prefix; 0: no checkpoints "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--max_checkpoints",
        metavar="N",
        type=int,
        default=DEFAULT_MAX_CHECKPOINTS,
        help="checkpoints per captured prompt at most (message ends first, then stride points "
        "spread evenly); each is a cache entry weighing its positions (default: %(default)s)",
    )
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
    p.add_argument(
        "--snapshot_dir",
        metavar="DIR",
        default=None,
        help="persist stored prompt snapshots as files in DIR (written behind the request path; "
        "restored into an engine on a lookup after an engine or service restart) "
        "(default: none, memory only)",
    )
    p.add_argument(
        "--snapshot_max_mb",
        metavar="MB",
        type=int,
        default=4096,
        help="the files in --snapshot_dir hold at most this many MiB; over it, files are deleted "
        "in --policy order (default: %(default)s)",
    )
    p.add_argument(
        "--snapshot_queue",
        metavar="N",
        type=int,
        default=32,
        help="snapshots waiting to be written at most; more are dropped and counted (default: %(default)s)",
    )
    p.add_argument(
        "--snapshot_preload",
        metavar="N",
        type=int,
        default=0,
        help="restore the N most recently used files into each engine when it (re)joins; 0 restores "
        "only on demand, at the first lookup of a prompt (default: %(default)s)",
    )
    add_serving_arguments(p, default_port=50052)
    add_auth_arguments(p)
    p.add_argument(
        "--shared_namespace",
        metavar="NAME",
        action="append",
        default=None,
        help="with --auth_tokens, the namespace NAME is every caller's (e.g. a common system prompt); "
        "any other belongs to its caller's owner. Repeatable (default: none)",
    )
    p.add_argument(
        "--admin_owner",
        metavar="OWNER",
        default="",
        help="the owner whose Stats and Clear cover every namespace; any other owner's cover its own "
        "(default: none; without --auth_tokens every caller's cover everything)",
    )
    p.add_argument(
        "--http_namespace",
        metavar="NAME",
        default=None,
        help="HTTP requests use this namespace, shared by every caller (as --shared_namespace); "
        "default: each caller's own (one namespace for all without --auth_tokens)",
    )
    p.add_argument(
        "--http_port",
        metavar="PORT",
        type=port_number,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, ...) on this port of "
        "--host, in this process, with the same tokens and TLS; 0 picks a free one "
        "(default: off)",
    )
    p.add_argument(
        "--http_model_name",
        metavar="NAME",
        default="",
        help="the model id HTTP clients send (default: the engine's model file name)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.engine and not args.engines:
        parser.error("one of --engine HOST:PORT or --engines dns:///NAME:PORT is required")
    for flag in (
        "snapshot_max_mb",
        "snapshot_queue",
        "snapshot_preload",
        "checkpoint_stride",
        "max_checkpoints",
    ):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag} must be >= 0, got {getattr(args, flag)}")
    if args.route_imbalance_abs < 0:
        parser.error(f"--route_imbalance_abs must be >= 0, got {args.route_imbalance_abs}")
    if not args.route_imbalance_rel >= 1:
        parser.error(f"--route_imbalance_rel must be >= 1, got {args.route_imbalance_rel}")
    return args


def connect_and_serve(args: argparse.Namespace):
    """Connect to the engine (releasing what an earlier instance left there) and start the gRPC server:
    (PrefixServer, bound port)."""
    from engine_service.serving.auth import ClientSecurity
    from engine_service.serving.service_main import server_security
    from engine_service.serving.tokens import read_token_file
    from prefix_service.cache.checkpoints import CheckpointPlan
    from prefix_service.engines.connect import connect_fleet
    from prefix_service.engines.engine_targets import engine_targets
    from prefix_service.fleet.cost_model import CostConfig
    from prefix_service.fleet.routing import routing_policy
    from prefix_service.rpc.server import create_server

    security = server_security(args)
    token = read_token_file(args.engine_token_file, "--engine_token_file") if args.engine_token_file else None
    engine_security = ClientSecurity(token, args.engine_tls_ca, args.engine_tls_cert, args.engine_tls_key)
    cost = CostConfig(
        args.route_min_reuse_fraction, args.route_min_reuse_positions, moves=args.route_moves == "on"
    )
    routing = routing_policy(
        args.routing,
        imbalance_abs=args.route_imbalance_abs,
        imbalance_rel=args.route_imbalance_rel,
        cost=cost,
    )
    tier = None
    if args.snapshot_dir:
        from prefix_service.tier.persistent_tier import PersistentTier

        tier = PersistentTier.open(
            args.snapshot_dir,
            args.snapshot_max_mb << 20,
            args.policy,
            queue_size=args.snapshot_queue,
            preload=args.snapshot_preload,
        )
    fleet, pool = connect_fleet(
        engine_targets(args.engine, args.engines, stale_after_s=args.dns_stale_after),
        policy=routing,
        tier=tier,
        ready_timeout=args.engine_timeout,
        resolve_every_s=args.resolve_every,
        leave_after_s=args.engine_leave_after,
        max_entries=args.max_entries,
        policy_name=args.policy,
        owner=args.owner,
        engine_security=engine_security,
        outage_wait_s=args.engine_outage_wait,
        engine_share=args.engine_share,
        max_positions=args.max_positions,
        checkpoints=CheckpointPlan(args.checkpoint_stride, args.max_checkpoints),
    )
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


def tenancy(args: argparse.Namespace):
    """The shared namespaces (--shared_namespace, --http_namespace) and the admin owner."""
    from prefix_service.gateway.tenancy import Tenancy

    shared = [
        *(args.shared_namespace or ()),
        *([args.http_namespace] if args.http_namespace is not None else []),
    ]
    return Tenancy.of(shared, args.admin_owner)


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
