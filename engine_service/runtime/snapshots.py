"""Export and import on the engine thread: the two commands, their futures (None with a refusal) and
handlers. An export copies committed positions between two forwards; an import checks header, then
arrays, before the executor allocates anything.
"""

from __future__ import annotations

import logging
import weakref
from array import array
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from engine_service.api.snapshot_files import LoadRefusal, SaveRefusal, StateLayout
from engine_service.cache.pinned_state import PinnedState
from engine_service.executors.base import Executor
from engine_service.persistence.snapshot import SessionSnapshot, header_refusal, mlx_state
from engine_service.runtime.commands import Command, EngineHooks
from engine_service.runtime.content_log import ContentLog

if TYPE_CHECKING:
    from engine_service.runtime.engine_loop import EngineLoop
    from engine_service.runtime.session import Session
    from engine_service.runtime.state import SessionRecord

log = logging.getLogger(__name__)


class ExportFuture(Future):
    """An export's future: the :class:`SessionSnapshot`, or None with :attr:`refusal` set."""

    def __init__(self) -> None:
        super().__init__()
        self.refusal: SaveRefusal | None = None

    def refuse(self, reason: SaveRefusal) -> None:
        self.refusal = reason
        self.set_result(None)


class ImportFuture(Future):
    """An import's future: the new Session, or None with :attr:`refusal` and :attr:`detail` set."""

    def __init__(self) -> None:
        super().__init__()
        self.refusal: LoadRefusal | None = None
        self.detail = ""

    def refuse(self, reason: LoadRefusal, detail: str = "") -> None:
        self.refusal, self.detail = reason, detail or reason.value
        self.set_result(None)

    @classmethod
    def refused(cls, reason: LoadRefusal, detail: str = "") -> ImportFuture:
        future = cls()
        future.refuse(reason, detail)
        return future


@dataclass(frozen=True, eq=False)
class PinnedSnapshot:
    """A new clone's or import's committed positions pinned (views, no copy) for exports on any
    thread; dropped on the engine thread when a generation starts on it or it closes."""

    fingerprint: str
    layout: StateLayout
    state: PinnedState
    content: tuple[int, ...]

    def export(self, upto: int) -> ExportFuture:
        """A resolved future of ``[0, upto)`` (BOUNDARY past the length or below a ring's floor); numpy
        copies on the calling thread."""
        future = ExportFuture()
        state = self.state.state(upto)
        if state is None:
            future.refuse(SaveRefusal.BOUNDARY)
        else:
            future.set_result(SessionSnapshot(self.fingerprint, self.layout, state, self.content[:upto]))
        return future


@dataclass(frozen=True)
class ExportCommand(Command):
    """Export positions ``[0, upto)`` of session ``key`` (None: all its committed positions); unrun or
    abandoned: refused STOPPING."""

    key: int
    future: ExportFuture
    upto: int | None = None

    def caller(self) -> ExportFuture:
        return self.future

    def abandon(self, exc: BaseException, hooks: EngineHooks) -> None:
        if not self.future.done():
            self.future.refuse(SaveRefusal.STOPPING)

    def settle_unrun(self, hooks: EngineHooks) -> None:
        if self.future.set_running_or_notify_cancel():
            self.future.refuse(SaveRefusal.STOPPING)


@dataclass(frozen=True)
class ImportCommand(Command):
    """Import ``snapshot`` as a new session; the future is held weakly (dropped: skipped)."""

    snapshot: SessionSnapshot
    future_ref: weakref.ref

    def caller(self) -> ImportFuture | None:
        return self.future_ref()

    def abandon(self, exc: BaseException, hooks: EngineHooks) -> None:
        future = self.future_ref()
        if future is not None and not future.done():
            future.refuse(LoadRefusal.STOPPING, "the engine stopped")

    def settle_unrun(self, hooks: EngineHooks) -> None:
        future = self.future_ref()
        if future is not None and future.set_running_or_notify_cancel():
            future.refuse(LoadRefusal.STOPPING, "the runner is stopping")


class SnapshotHandlers:
    """The engine loop's export and import handlers; ``adopt(sid, content, pin)`` makes a Session."""

    def __init__(
        self, loop: EngineLoop, executor: Executor, adopt: Callable[[int, ContentLog, bool], Session]
    ) -> None:
        self._loop = loop
        self._executor = executor
        self._adopt = adopt

    def on_export(self, cmd: ExportCommand) -> None:
        future = cmd.future
        if not future.set_running_or_notify_cancel():
            return
        loop = self._loop
        rec = loop.records.get(cmd.key)
        if rec is None or rec.poisoned or rec.closed:
            future.refuse(SaveRefusal.SOURCE_UNUSABLE)
            return
        layout = self._executor.state_layout()
        if layout is None:
            future.refuse(SaveRefusal.UNSUPPORTED)
            return
        upto = rec.position if cmd.upto is None else cmd.upto
        if upto > rec.position:
            future.refuse(SaveRefusal.BOUNDARY)
            return
        content = rec.content.values(upto)
        if any(t < 0 for t in content):
            future.refuse(SaveRefusal.PREPARED_INPUT)
            return
        try:
            state = self._executor.export_session(rec.sid, upto)
        except Exception as exc:  # like a clone: a failure inside the executor is a refusal
            log.warning(
                "executor.export_session(%d, %d) raised %s: %s", rec.sid, upto, type(exc).__name__, exc
            )
            state = None
        if state is None or state.length != upto:
            future.refuse(SaveRefusal.BOUNDARY)
            return
        # contiguous copies (a writer hashes their bytes); evaluated here, on the thread that owns MLX
        arrays = {name: mx.contiguous(a) for name, a in state.arrays.items()}
        mx.eval(list(arrays.values()))
        state = type(state)(state.length, state.written, arrays)
        future.set_result(SessionSnapshot(loop.fingerprint, layout, state, content))

    def pin(self, rec: SessionRecord) -> None:
        """Pin ``rec`` (a new clone or import) for exports on any thread, where the executor pins
        without a copy and it holds no prepared input."""
        content = rec.content.values(rec.position)
        layout = self._executor.state_layout()
        if layout is None or any(t < 0 for t in content):
            return
        try:
            state = self._executor.pin_session(rec.sid)
        except Exception:  # an optimisation only: exports then run on the engine thread
            log.exception("executor.pin_session(%d) failed", rec.sid)
            return
        if state is not None and state.length == rec.position:
            rec.pinned = PinnedSnapshot(self._loop.fingerprint, layout, state, tuple(content))

    def on_import(self, cmd: ImportCommand) -> None:
        future = cmd.future_ref()
        if future is None or not future.set_running_or_notify_cancel():
            return  # abandoned before it ran: nobody could own the session, so none is made
        loop = self._loop
        snapshot = cmd.snapshot
        refusal = header_refusal(
            snapshot, loop.fingerprint, self._executor.state_layout(), loop.limits.max_session_tokens
        )
        if refusal is not None:
            future.refuse(*refusal)
            return
        state = mlx_state(snapshot.state)
        problem = self._executor.import_problem(state)
        if problem is not None:
            future.refuse(LoadRefusal.SHAPE, problem)
            return
        sid = self._executor.import_session(state, snapshot.content)
        if sid is None:
            future.refuse(
                LoadRefusal.NO_ROOM, f"no free session slot or room for {snapshot.positions} positions"
            )
            return
        future.set_result(self._adopt(sid, ContentLog(array("i", snapshot.content)), True))
