"""EngineLoop: the state the engine thread owns, and its loop: drain commands -> reap cancelled -> run
one batch -> deliver outputs. Other threads only :meth:`EngineLoop.put` and read single attributes."""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

import mlx.core as mx

from engine_service.api.engine_info import WindowGeometry
from engine_service.api.limits import EngineLimits
from engine_service.api.stream_events import FinishReason
from engine_service.executors.base import Executor
from engine_service.model.compute_path import ComputePath
from engine_service.runtime.commands import (
    BarrierCommand,
    CancelCommand,
    CloneCommand,
    CloseCommand,
    Command,
    CommandTable,
    EngineHooks,
    OpenCommand,
    StartCommand,
)
from engine_service.runtime.delivery import BatchObserver, Delivery
from engine_service.runtime.scheduler import plan_batch
from engine_service.runtime.session_handlers import SessionHandlers
from engine_service.runtime.snapshots import ExportCommand, ImportCommand, SnapshotHandlers
from engine_service.runtime.state import ActiveGeneration, SessionRecord

if TYPE_CHECKING:
    from engine_service.runtime.runner import Runner

__all__ = ["BatchObserver", "EngineLoop"]

log = logging.getLogger(__name__)

# After answering a Clone, the engine waits this long for the caller's next command (the prefix
# service's Generate on the clone) before a forward that prefills at least LINGER_MIN_POSITIONS: that
# forward can take a second on a CPU, and a Generate arriving just after it started would wait all of it.
LINGER_S = 0.02
LINGER_MIN_POSITIONS = 128

COUNTERS = (
    "steps",
    "forward_batches",
    "failed_batches",
    "tokens_decoded",
    "prefill_positions",
    "generations_started",
    "generations_finished",
    "clones_succeeded",
    "clones_refused",
)


class EngineLoop:
    """Engine-thread state of one :class:`Runner`: session records, live generations, counters."""

    def __init__(self, runner: Runner, executor: Executor, max_decode: int, shared_tokens: int = 0) -> None:
        self._executor = executor
        self.cache_kind = str(getattr(executor, "cache_kind", ""))  # "": an executor without a KV cache
        self._max_decode = max_decode
        self._shared_tokens = shared_tokens
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Guards ``accepting`` against submissions racing the final drain at shutdown. Closes are put
        # without it (finalizers must never take a lock); an unhandled close after teardown is moot.
        self.submit_lock = threading.Lock()
        self.accepting = True
        self.stop_requested = False
        self.records: dict[int, SessionRecord] = {}
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.limits: EngineLimits | None = None
        self.fingerprint = ""
        self.compute_path: ComputePath | None = None
        self.window_geometry: WindowGeometry | None = None
        self.pins_exports = False
        self.startup_error: BaseException | None = None
        self.ready = threading.Event()
        self.batch_observer: BatchObserver | None = None  # set by metrics; read once per batch
        self.active: list[ActiveGeneration] = []  # started, not finished; in start order
        self.runner = runner  # sessions handed to callers point at the runner, not at this loop
        self._delivery = Delivery(self, executor)
        self.finish = self._delivery.finish
        sessions = SessionHandlers(self, executor)
        self.snapshots = SnapshotHandlers(self, executor, sessions.adopt)
        self._table = CommandTable(
            {
                OpenCommand: sessions.on_open,
                CloneCommand: sessions.on_clone,
                CloseCommand: sessions.on_close,
                StartCommand: sessions.on_start,
                CancelCommand: sessions.on_cancel,
                BarrierCommand: BarrierCommand.resolve,
                ExportCommand: self.snapshots.on_export,
                ImportCommand: self.snapshots.on_import,
            }
        )
        self._hooks = EngineHooks(self.finish, self._table.dispatch, self.counts)

    def put(self, command: object) -> bool:
        """Queue ``command`` unless the engine is stopping (then False). Unknown types raise TypeError."""
        if not self._table.handles(command):
            raise TypeError(f"unknown command {type(command).__name__}")
        with self.submit_lock:
            if not self.accepting or self.stop_requested:
                return False
            self.inbox.put(command)
            return True

    def run(self) -> None:
        try:
            self.limits = self._executor.limits()
            self.fingerprint = self._executor.fingerprint()
            self.compute_path = self._executor.compute_path()
            self.window_geometry = self._executor.window_geometry()
            self.pins_exports = self._executor.pins_exports()
        except BaseException as exc:  # reported to the constructor's thread
            self.startup_error = exc
            self.accepting = False
            self.ready.set()
            return
        self.ready.set()
        try:
            while not self.stop_requested:
                self.counts["steps"] += 1
                cloned = self._drain(block=not self.active)  # idle: block on the inbox, no busy spin
                if cloned and self._long_prefill_next():
                    self._drain(block=True, timeout=LINGER_S)
                if self.stop_requested:
                    break
                self._reap_cancelled()
                self._step()
        finally:
            self._teardown()
            # MLX >= 0.32 wants each thread's streams released before the thread and the interpreter
            # end; without it a process can abort at exit ("terminate called without an active exception").
            clear_streams = getattr(mx, "clear_streams", None)
            if clear_streams is not None:
                clear_streams()

    @property
    def active_generations(self) -> int:
        return len(self.active)

    def _long_prefill_next(self) -> bool:
        return any(g.prefilling and g.prefill_left() >= LINGER_MIN_POSITIONS for g in self.active)

    def _drain(self, *, block: bool, timeout: float | None = None) -> bool:
        """Dispatch the queued commands; whether one was a Clone."""
        cloned = False
        try:
            command = self.inbox.get(timeout=timeout) if block else self.inbox.get_nowait()
        except queue.Empty:
            return cloned
        while True:
            cloned = cloned or isinstance(command, CloneCommand)
            self._dispatch(command)
            if self.stop_requested:
                return cloned
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return cloned

    def _dispatch(self, command: Command) -> None:
        try:
            self._table.dispatch(command)
        except Exception as exc:  # a handler bug must not take the engine down; settle the caller
            log.exception("command %s failed", type(command).__name__)
            command.fail(exc, self._hooks)
        except BaseException as exc:
            # Not an error the engine survives (SystemExit...): teardown settles only what is still
            # queued or active, so settle the caller of this command before the thread dies.
            command.abandon(exc, self._hooks)
            raise

    def _reap_cancelled(self) -> None:
        for gen in [g for g in self.active if g.cancel_requested]:
            self.finish(gen, FinishReason.CANCELLED)

    def _step(self) -> None:
        # A method, not inline in the loop: the plan must not stay referenced while the engine idles
        # (it holds generation handles, which hold sessions that would then never be collected).
        budget = self._executor.preferred_batch_tokens()
        plan = plan_batch(self.active, self._max_decode, budget, self.counts["steps"], self._shared_tokens)
        if plan.inputs:
            self._delivery.run(plan)

    def _teardown(self) -> None:
        """Finish live generations as cancelled, settle queued commands without an executor call, close
        every session."""
        with self.submit_lock:
            self.accepting = False  # from here on no future can be queued unsettled
        for gen in list(self.active):
            self.finish(gen, FinishReason.CANCELLED)
        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
            try:  # never an executor call for it (a queued close still releases its session)
                command.settle_unrun(self._hooks)
            except Exception:
                log.exception("settling %s at shutdown failed", type(command).__name__)
        for rec in list(self.records.values()):
            rec.closed, rec.pinned = True, None
            try:
                self._executor.close_session(rec.sid)
            except Exception:
                log.exception("executor.close_session(%d) failed at shutdown", rec.sid)
        self.records.clear()
