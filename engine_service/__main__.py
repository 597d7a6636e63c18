"""forkline-engine (python -m engine_service): serve the engine over gRPC; prints "forkline-engine
listening on HOST:PORT" once it serves. SIGTERM / SIGINT drain: health NOT_SERVING, new work UNAVAILABLE,
--grace seconds for calls in flight. Health: docs/DEPLOY.md; quotas, auth: docs/SECURITY.md; snapshot
keys: docs/SNAPSHOTS.md.
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
    from engine_service.model.loading.loader import load_model
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
