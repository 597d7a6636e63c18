"""``python -m tests.service.tiny_engine [forkline-engine flags]``: the engine's own main (argument
parsing, ``run_service``'s signal handling and drain) over the tests' tiny model instead of a packaged
one (``--host``, ``--snapshot_key``, ``--role``, ``--kv_dtype`` and ``--idle_session_timeout`` honoured),
each forward slowed by ``FORKLINE_TEST_STEP_S`` seconds so that a generation lasts long enough to be
interrupted. A real process for the drain tests: SIGTERM reaches it as it would in a pod."""

from __future__ import annotations

import os
import sys
import time

from engine_service.__main__ import parse_args
from engine_service.persistence.snapshot_key import read_snapshot_key
from engine_service.serving.service_main import run_service
from tests.service.conftest import start_engine

STEP_ENV = "FORKLINE_TEST_STEP_S"


def start(args):
    key = read_snapshot_key(args.snapshot_key) if args.snapshot_key else None
    engine = start_engine(
        port=args.port,
        host=args.host,
        max_sessions=8,
        stuck_after_s=args.stuck_after,
        snapshot_key=key,
        role=args.role,
        kv_dtype=args.kv_dtype,
        idle_timeout_s=args.idle_session_timeout,
    )
    step_s = float(os.environ.get(STEP_ENV, "0"))
    executor = engine.runner._engine._executor
    execute = executor.execute

    def slowed(batch):
        time.sleep(step_s)
        return execute(batch)

    executor.execute = slowed
    return engine.server, engine.port


def main(argv: list[str] | None = None, starter=None) -> int:
    """The engine's own main over the tiny model; ``starter``: another ``start`` (e.g. held_engine's)."""
    return run_service(
        "forkline-engine",
        parse_args(argv),
        starter or start,
        lambda server, a: server.stop(a.grace, shutdown_runner=True),
    )


if __name__ == "__main__":
    sys.exit(main())
