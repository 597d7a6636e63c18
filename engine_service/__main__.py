"""forkline-engine (also python -m engine_service): serve the engine over gRPC.

Loads the model once and serves sessions, generation, clones, tokenization and model info, with gRPC
health checking and reflection. Prints "forkline-engine listening on HOST:PORT" once it serves
(--port 0 picks a free port). SIGTERM / SIGINT drain gracefully: health turns NOT_SERVING (and Info
says draining), new work gets UNAVAILABLE, generations in flight get up to --grace seconds, then
every session is closed and the engine thread stops. Health: the readiness name
forkline.engine.v1.Engine and "" are NOT_SERVING while draining or while the engine thread has not
answered for --stuck_after seconds; forkline.liveness only for the latter (probe liveness on it).

Threads: unless FORKLINE_KERNEL_THREADS / OPENBLAS_NUM_THREADS are set, the kernels and OpenBLAS get
as many threads as the cgroup CPU quota (a container's CPU limit) allows, else the CPUs the process
may run on (logged at start, and in Info's compute_path).

With --auth_tokens every call needs a bearer token and runs as the token's owner (SIGHUP re-reads the
file); --tls_cert / --tls_key serve TLS, --tls_client_ca also requires client certificates. Without
them owners are self-declared (a warning is logged when listening on a non-loopback address).

Quotas: each client owner holds at most --owner_max_sessions resident sessions (live generations
count, as do kept sessions, clones and snapshots) and --owner_max_positions positions; each
--persistent_owner (the prefix service) has --persistent_owner_share of the engine's sessions and
positions instead. Over quota is RESOURCE_EXHAUSTED naming the quota. Idle client handles expire
after --idle_session_timeout; a persistent owner's never do.

Snapshot files (ExportSession / ImportSession, the prefix service's --snapshot_dir): with
--snapshot_key FILE they are signed with a keyed MAC, and a file the key does not verify is refused
(unsigned, bad_signature) before any tensor is read; without it, whoever can write the folder can
make the engine load any K/V under any prompt.
"""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    from engine_service.api.owners import PERSISTENT_OWNER
    from engine_service.executors.options import DEFAULTS, add_executor_options, add_model_options
    from engine_service.serving.service_main import add_auth_arguments, add_serving_arguments

    p = argparse.ArgumentParser(
        prog="forkline-engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_options(p)
    add_executor_options(p, max_sessions=DEFAULTS.max_sessions)
    p.add_argument(
        "--idle_session_timeout",
        metavar="SECONDS",
        type=float,
        default=300.0,
        help="seconds after which an idle client session handle expires; 0: never (default: %(default)s)",
    )
    p.add_argument(
        "--persistent_owner",
        action="append",
        default=None,
        metavar="OWNER",
        help="an owner whose handles never expire and who has the persistent budget instead of the "
        f"client quota; repeatable (default: {PERSISTENT_OWNER}, unless --persistent_owner_prefix is given)",
    )
    p.add_argument(
        "--persistent_owner_prefix",
        action="append",
        default=None,
        metavar="PREFIX",
        help="every owner whose id starts with PREFIX is a persistent owner (prefix replicas "
        "forkline-prefix-0, -1, ... join without a change here; with --auth_tokens only tokens the "
        "operator maps to such an owner can be one); repeatable (default: none)",
    )
    p.add_argument(
        "--stuck_after",
        metavar="SECONDS",
        type=float,
        default=30.0,
        help="health turns NOT_SERVING (readiness and forkline.liveness) when the engine thread has "
        "not answered for this long; above the longest forward (default: %(default)s)",
    )
    p.add_argument(
        "--owner_max_sessions",
        metavar="N",
        type=int,
        default=None,
        help="resident sessions one client owner may hold, live or kept (clones and snapshots "
        "included); 0: no limit (default: a quarter of --max_sessions, at least 1)",
    )
    p.add_argument(
        "--owner_max_positions",
        metavar="N",
        type=int,
        default=None,
        help="positions one client owner's sessions may hold together (a generation reserves "
        "position + input + min(max_new_tokens, G) and grows by G as it runs, ending with finish "
        "reason 'length' when no more fits; G = 256, or max_session_tokens / 8 when smaller); "
        "0: no limit "
        "(default: owner_max_sessions * max_session_tokens / 2)",
    )
    p.add_argument(
        "--persistent_owner_share",
        metavar="F",
        type=float,
        default=0.5,
        help="share of the engine's sessions and positions each persistent owner (the prefix "
        "service) may hold, in [0, 1]; 0: no limit (default: %(default)s)",
    )
    p.add_argument(
        "--snapshot_key",
        metavar="FILE",
        default=None,
        help="a secret (at least 32 bytes; mode 600 or 640) that signs exported snapshot files with "
        "a keyed MAC; imports must carry a valid MAC (default: none, files are checksummed only)",
    )
    p.add_argument(
        "--prepared_inputs",
        action="store_true",
        help="also accept prepared 'embeddings' inputs (EmbeddingsExecutor); off by default",
    )
    add_serving_arguments(p, default_port=50051)
    add_auth_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def start_engine(args: argparse.Namespace):
    """Load the model, start the engine thread and the gRPC server: (EngineServer, bound port)."""
    from engine_service.api.errors import InvalidArgument
    from engine_service.api.owners import PERSISTENT_OWNER, PersistentOwners
    from engine_service.cpu_quota import apply_cpu_quota
    from engine_service.model.loading.loader import load_model
    from engine_service.persistence.snapshot_key import read_snapshot_key
    from engine_service.rpc.server import create_server
    from engine_service.serving.service_main import server_security
    from engine_service.sessions.engine import EngineSessions
    from engine_service.sessions.handles import engine_quotas

    security = server_security(args)  # a bad token file or TLS flag fails before the model loads
    quota, persistent_quota = engine_quotas(  # bad quota flags fail before the model loads too
        args.max_sessions,
        args.max_session_tokens,
        owner_max_sessions=args.owner_max_sessions,
        owner_max_positions=args.owner_max_positions,
        persistent_owner_share=args.persistent_owner_share,
    )
    snapshot_key = read_snapshot_key(args.snapshot_key) if args.snapshot_key else None  # before the model
    if snapshot_key is not None:
        logging.getLogger("forkline-engine").info(
            "snapshot files signed with the key in %s", args.snapshot_key
        )
    if not args.stuck_after > 0:
        raise InvalidArgument(f"--stuck_after must be > 0, got {args.stuck_after}")
    persistent = PersistentOwners(
        args.persistent_owner or (() if args.persistent_owner_prefix else (PERSISTENT_OWNER,)),
        args.persistent_owner_prefix or (),
    )
    apply_cpu_quota()  # before the first kernel call: the pools follow the container's CPU limit
    loaded = load_model(args.model, args.weights_dtype)
    if args.deterministic:  # FailedPrecondition (no kernels, float weights) before anything serves
        from engine_service.model import deterministic

        deterministic.enable(loaded)
    deps = EngineSessions.build(
        loaded,
        loaded.tokenizer,
        model_name=loaded.path,
        chat=loaded.chat,
        cache_kind=args.cache_kind,
        max_sessions=args.max_sessions,
        max_session_tokens=args.max_session_tokens,
        max_decode_sequences=args.max_decode_sequences,
        prefill_chunk=args.prefill_chunk,
        kv_dtype=args.kv_dtype,
        idle_timeout_s=args.idle_session_timeout,
        persistent_owners=persistent,
        prepared_inputs=args.prepared_inputs,
        quota=quota,
        persistent_quota=persistent_quota,
        snapshot_key=snapshot_key,
    )
    return create_server(
        deps,
        f"{args.host}:{args.port}",
        security=security,
        metrics=args.metrics_port is not None,
        stuck_after_s=args.stuck_after,
    )


def main(argv: list[str] | None = None) -> int:
    from engine_service.serving.service_main import run_service

    # the engine thread stops with the server: the process is going away
    return run_service(
        "forkline-engine",
        parse_args(argv),
        start_engine,
        lambda server, args: server.stop(args.grace, shutdown_runner=True),
    )


if __name__ == "__main__":
    sys.exit(main())
