"""RunnerBackend: the prefix cache's backend over a local Runner (the CLI's embedded prefix cache).

It implements ``prefix_service.cache.session_backend.CaptureBackend`` structurally (the engine never
imports the prefix service; a test holds the two together): handles are the Runner's :class:`Session` objects,
``clone`` waits for the engine (never call it from a generation callback), ``clone_async`` only queues.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from engine_service.api.answers import CloneRefusal, TakenClone

if TYPE_CHECKING:
    from engine_service.runtime.runner import Runner
    from engine_service.runtime.session import Session


class RunnerBackend:
    """See the module docstring."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner

    @property
    def runner(self) -> Runner:
        return self._runner

    @property
    def fingerprint(self) -> str:
        return self._runner.fingerprint

    def clone(self, handle: Session, upto: int) -> Session | None:
        if not handle.valid:  # a dead session (closed, or its runner stopped): no engine call
            return None
        return handle.clone_async(upto).result()

    def clone_or_refusal(self, handle: Session, upto: int) -> TakenClone:
        if not handle.valid:
            return TakenClone(None, CloneRefusal.SOURCE_UNUSABLE)
        future = handle.clone_async(upto)
        child = future.result()
        return TakenClone(child, None if child is not None else getattr(future, "refusal", None))

    @property
    def max_rewind(self) -> int | None:
        window = self._runner.window_geometry
        return window.max_write if window is not None and window.evicts else None

    def clone_async(self, handle: Session, upto: int) -> Future:
        return handle.clone_async(upto)

    def close(self, handle: Session) -> None:
        handle.close()

    def position(self, handle: Session) -> int:
        return handle.position

    def valid(self, handle: Session) -> bool:
        return handle.valid

    def content_digest(self, handle: Session) -> bytes | None:
        return handle.content_digest()  # read from the runner's record of the (idle) snapshot
