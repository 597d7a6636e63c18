"""``python -m tests.service.held_engine [forkline-engine flags]``: ``tiny_engine`` whose forwards stop at a
hold file, so a test can keep a stream in flight for as long as its checks take, however loaded the
machine. ``FORKLINE_TEST_HOLD`` names the file; while it exists and holds N, forwards after the N-th
since it appeared wait until it is removed, and ``waiting_marker(hold)`` exists while one waits (the
engine thread is inside that forward). Pass a ``--stuck_after`` longer than any hold."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.service import tiny_engine

HOLD_ENV = "FORKLINE_TEST_HOLD"


def waiting_marker(hold: Path) -> Path:
    """The file that exists while a forward waits at ``hold``."""
    return hold.with_suffix(".waiting")


def held(execute: Callable, hold: Path) -> Callable:
    passed = 0  # forwards run while the hold file existed
    waiting = waiting_marker(hold)

    def limit() -> int | None:
        try:
            return int(hold.read_text())
        except (FileNotFoundError, ValueError):  # removed, or not yet written whole
            return None

    def execute_held(batch):
        nonlocal passed
        if (n := limit()) is not None and passed >= n:
            waiting.touch()
            while (n := limit()) is not None and passed >= n:
                time.sleep(0.01)
            waiting.unlink(missing_ok=True)
        passed += limit() is not None
        return execute(batch)

    return execute_held


def start(args):
    server, port = tiny_engine.start(args)
    executor = server.deps.runner._engine._executor
    executor.execute = held(executor.execute, Path(os.environ[HOLD_ENV]))
    return server, port


def main(argv: list[str] | None = None) -> int:
    return tiny_engine.main(argv, start)


if __name__ == "__main__":
    sys.exit(main())
