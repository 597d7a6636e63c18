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
import dataclasses
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_service.executors.options import ExecutorSettings


def build_parser() -> argparse.ArgumentParser:
    from engine_service.executors.options import DEFAULTS, add_executor_options, add_model_options
    from engine_service.runtime.heartbeat import DEFAULT_STUCK_AFTER_S
    from engine_service.serving.service_main import add_auth_arguments, add_serving_arguments
    from engine_service.sessions.settings import add_session_options

    p = argparse.ArgumentParser(
        prog="forkline-engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_options(p)
    add_executor_options(p, max_sessions=DEFAULTS.max_sessions)
    add_session_options(p)
    p.add_argument(
        "--stuck_after",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_STUCK_AFTER_S,
        help="health turns NOT_SERVING (readiness and forkline.liveness) when the engine thread has "
        "not answered for this long; above the longest forward (default: %(default)s)",
    )
    add_serving_arguments(p, default_port=50051)
    add_auth_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def executor_settings(args: argparse.Namespace) -> ExecutorSettings:
    """The executor the flags of ``add_executor_options`` / ``add_model_options`` ask for."""
    from engine_service.executors.options import ExecutorSettings

    return ExecutorSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ExecutorSettings)})


def start_engine(args: argparse.Namespace):
    """Load the model, start the engine thread and the gRPC server: (EngineServer, bound port)."""
    from engine_service.api.checks import checked_float
    from engine_service.cpu_quota import apply_cpu_quota
    from engine_service.model.loader import load_model
    from engine_service.rpc.server import create_server
    from engine_service.serving.service_main import server_security
    from engine_service.sessions.engine import EngineSessions
    from engine_service.sessions.settings import session_settings

    # every flag is checked before the model loads: tokens and TLS, limits, quotas, the snapshot key
    security = server_security(args)
    executor = executor_settings(args)
    settings = session_settings(args, executor)
    checked_float("--stuck_after", args.stuck_after, lo=0, lo_open=True)
    apply_cpu_quota()  # before the first kernel call: the pools follow the container's CPU limit
    loaded = load_model(args.model, executor.weights_dtype)
    if args.deterministic:  # FailedPrecondition (no kernels, float weights) before anything serves
        from engine_service.model import deterministic

        deterministic.enable(loaded)
    sessions = EngineSessions.build(
        loaded,
        loaded.tokenizer,
        model_name=loaded.path,
        chat=loaded.chat,
        executor=executor,
        sessions=settings,
    )
    return create_server(
        sessions,
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
