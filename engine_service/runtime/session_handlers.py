"""The engine loop's handlers for the session commands: open, clone, close, start and cancel a
generation (engine thread only)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from engine_service.api.answers import CloneRefusal
from engine_service.api.errors import EngineFull, FailedPrecondition, GenerationError, InvalidArgument
from engine_service.api.stream_events import FinishReason
from engine_service.executors.base import Executor
from engine_service.executors.sampling import SamplingParams
from engine_service.runtime.commands import (
    CancelCommand,
    CloneCommand,
    CloseCommand,
    OpenCommand,
    StartCommand,
)
from engine_service.runtime.content_log import ContentLog
from engine_service.runtime.scheduler import check_input, drawn_ids
from engine_service.runtime.session import Session
from engine_service.runtime.state import SessionRecord

if TYPE_CHECKING:
    from engine_service.runtime.engine_loop import EngineLoop

log = logging.getLogger(__name__)


class SessionHandlers:
    """Session commands of one :class:`EngineLoop`; :meth:`adopt` is shared with imports."""

    def __init__(self, loop: EngineLoop, executor: Executor) -> None:
        self._loop = loop
        self._executor = executor
        self._next_key = 0

    def on_open(self, cmd: OpenCommand) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        sid = self._executor.open_session()
        if sid is None:
            cmd.future.set_exception(EngineFull(self._loop.limits.max_sessions))
            return
        cmd.future.set_result(self.adopt(sid, ContentLog()))

    def adopt(self, sid: int, content: ContentLog, pin: bool = False) -> Session:
        """Executor session ``sid`` as a runner Session holding ``content``; ``pin``: a clone or an
        import, whose export is then served off the engine thread (``SnapshotHandlers.pin``)."""
        key = self._next_key
        self._next_key += 1
        rec = SessionRecord(key=key, sid=sid, position=len(content), content=content)
        self._loop.records[key] = rec
        if pin:
            self._loop.snapshots.pin(rec)
        return Session(self._loop.runner, rec)

    def on_clone(self, cmd: CloneCommand) -> None:
        future = cmd.future_ref()
        if future is None or not future.set_running_or_notify_cancel():
            return  # abandoned before it ran: nobody could own the child, so none is made
        rec = self._loop.records.get(cmd.key)
        refusal = _clone_refusal(rec, cmd)
        child: Session | None = None
        if refusal is None:
            try:
                sid = self._executor.clone(rec.sid, cmd.upto)
            except Exception as exc:  # an exception inside clone is a refusal
                log.warning(
                    "executor.clone(%d, %d) raised %s: %s", rec.sid, cmd.upto, type(exc).__name__, exc
                )
                sid = None
            if sid is not None:
                child = self.adopt(sid, rec.content.prefix(cmd.upto), pin=True)
            else:
                refusal = (
                    CloneRefusal.WINDOW if cmd.upto < self._clone_floor(rec.sid) else CloneRefusal.BOUNDARY
                )
        self._loop.counts["clones_succeeded" if child is not None else "clones_refused"] += 1
        if child is None:
            future.refuse(refusal)
        else:
            future.set_result(child)

    def _clone_floor(self, sid: int) -> int:
        """The executor's floor for clones of ``sid`` (a ring's rewind floor; 0 when it cannot say)."""
        try:
            return self._executor.clone_floor(sid)
        except Exception:  # a diagnostic only: the refusal stands either way
            log.exception("executor.clone_floor(%d) failed", sid)
            return 0

    def on_close(self, cmd: CloseCommand) -> None:
        rec = self._loop.records.get(cmd.key)
        if rec is None:
            return
        rec.closed, rec.pinned = True, None
        if rec.generation is not None:
            self._loop.finish(rec.generation, FinishReason.CANCELLED)
        del self._loop.records[cmd.key]
        try:
            self._executor.close_session(rec.sid)
        except Exception:
            log.exception("executor.close_session(%d) failed", rec.sid)

    def on_start(self, cmd: StartCommand) -> None:
        loop, gen = self._loop, cmd.generation
        rec = loop.records.get(cmd.key)
        loop.counts["generations_started"] += 1
        if rec is None or rec.closed:
            loop.finish(gen, FinishReason.ERROR, FailedPrecondition(f"session {cmd.key} is closed"))
            return
        if rec.poisoned or rec.generation is not None:
            state = "failed earlier" if rec.poisoned else "already generating"
            loop.finish(gen, FinishReason.ERROR, FailedPrecondition(f"session {cmd.key} is {state}"))
            return
        gen.record = rec
        rec.pinned = None  # the generation writes the session: its export goes back to this thread
        rec.generation = gen
        rec.busy = True
        gen.started_at = time.perf_counter()
        problem = check_input(gen.input, rec, loop.limits, self._executor)
        if problem is not None:
            loop.finish(gen, FinishReason.ERROR, problem)
            return
        try:
            drawn = drawn_ids(gen.input, rec, gen.config.drawn_tokens, bool(gen.config.json_schema))
        except InvalidArgument as exc:
            loop.finish(gen, FinishReason.ERROR, exc)
            return
        try:
            self._executor.set_sampling(rec.sid, SamplingParams.of(gen.config, drawn), gen.config.seed)
        except Exception as exc:
            loop.finish(
                gen, FinishReason.ERROR, GenerationError(f"set_sampling failed: {type(exc).__name__}: {exc}")
            )
            return
        gen.segments = ([(rec.pending,)] if rec.pending is not None else []) + [gen.input]
        gen.last_step = loop.counts["steps"]
        loop.active.append(gen)

    @staticmethod
    def on_cancel(cmd: CancelCommand) -> None:
        cmd.generation.cancel_requested = True


def _clone_refusal(rec: SessionRecord | None, cmd: CloneCommand) -> CloneRefusal | None:
    """Why the runner refuses ``cmd`` before asking the executor (None: ask it)."""
    if rec is None or rec.poisoned:
        return CloneRefusal.SOURCE_UNUSABLE
    # Only the runner's accepted position authorizes a clone: a speculative executor may have
    # physically written past it, and the pending token is not written at all.
    if not 0 <= cmd.upto <= rec.position:
        return CloneRefusal.POSITION
    if cmd.expected_digest is not None:
        # Checked here, on the engine thread, so no generation can change [0, upto) in between.
        digest = rec.content.digest(cmd.upto)
        if digest is None:
            return CloneRefusal.PREPARED_INPUT
        if digest != cmd.expected_digest:
            return CloneRefusal.CONTENT_MISMATCH
    return None
