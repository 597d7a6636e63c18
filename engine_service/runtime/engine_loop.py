"""EngineLoop: the state the engine thread owns, and the loop it runs.

Only the engine thread calls the executor, creates or changes session records and generations. Other
threads reach it through :meth:`EngineLoop.put` (commands on a ``queue.SimpleQueue``) and read a few
single attributes (``records`` size, ``counts``, ``accepting``). The loop::

    while not stopping: drain commands -> reap cancelled -> run one batch -> deliver outputs

Commands queued by an output callback are drained before the next forward. With no live generation
the thread blocks on the inbox (no busy spin). Teardown finishes live generations as cancelled,
settles every queued command without calling the executor for it, and closes every session.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from engine_service.api.answers import CloneRefusal
from engine_service.api.engine_info import WindowGeometry
from engine_service.api.errors import EngineFull, FailedPrecondition, GenerationError
from engine_service.api.limits import EngineLimits
from engine_service.api.logprobs import TokenLogprob
from engine_service.api.stream_events import FinishReason
from engine_service.executors.base import ExecOutput, Executor
from engine_service.executors.sampling import SamplingParams
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
from engine_service.runtime.content_log import ContentLog
from engine_service.runtime.generation import GenerationUpdate
from engine_service.runtime.scheduler import BatchPlan, PlannedInput, check_input, plan_batch
from engine_service.runtime.session import Session
from engine_service.runtime.snapshots import ExportCommand, ImportCommand, SnapshotHandlers
from engine_service.runtime.state import ActiveGeneration, SessionRecord

if TYPE_CHECKING:
    from engine_service.runtime.runner import Runner

log = logging.getLogger(__name__)

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

# Called on the engine thread after every forward with (rows, positions, seconds): the inputs in the
# batch, the positions they fed, and the wall time of ``executor.execute``. Must be cheap and not raise.
BatchObserver = Callable[[int, int, float], None]


class EngineLoop:
    """Engine-thread state of one :class:`Runner`: session records, live generations, counters."""

    def __init__(self, runner: Runner, executor: Executor, max_decode: int) -> None:
        self._runner = runner  # sessions handed to callers point at the runner, not at this loop
        self._executor = executor
        self._max_decode = max_decode
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
        self._active: list[ActiveGeneration] = []
        self._next_key = 0
        self._snapshots = SnapshotHandlers(self, executor, self._adopt)
        self._table = CommandTable(
            {
                OpenCommand: self._on_open,
                CloneCommand: self._on_clone,
                CloseCommand: self._on_close,
                StartCommand: self._on_start,
                CancelCommand: self._on_cancel,
                BarrierCommand: BarrierCommand.resolve,
                ExportCommand: self._snapshots.on_export,
                ImportCommand: self._snapshots.on_import,
            }
        )
        self._hooks = EngineHooks(self._finish, self._table.dispatch, self.counts)

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
        """The engine thread's body: start up, loop until stopped, tear down."""
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
                self._drain(block=not self._active)
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
        """Generations the engine thread is running now (started, not finished)."""
        return len(self._active)

    def _drain(self, *, block: bool) -> None:
        try:
            command = self.inbox.get() if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._dispatch(command)
            if self.stop_requested:
                return
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return

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
        for gen in [g for g in self._active if g.cancel_requested]:
            self._finish(gen, FinishReason.CANCELLED)

    def _step(self) -> None:
        # A method, not inline in the loop: the plan must not stay referenced while the engine idles
        # (it holds generation handles, which hold sessions that would then never be collected).
        plan = plan_batch(
            self._active, self._max_decode, self._executor.preferred_batch_tokens(), self.counts["steps"]
        )
        if plan.inputs:
            self._run_batch(plan)

    def _run_batch(self, plan: BatchPlan) -> None:
        self.counts["forward_batches"] += 1
        started = time.perf_counter()
        try:
            outputs = self._executor.execute([p.input for p in plan.inputs])
            if len(outputs) != len(plan.inputs):
                raise GenerationError(
                    f"executor returned {len(outputs)} outputs for {len(plan.inputs)} inputs"
                )
        except Exception as exc:
            # A failed batch poisons every session in it; other sessions and the engine carry on.
            self.counts["failed_batches"] += 1
            log.warning("batch of %d inputs failed: %s", len(plan.inputs), exc)
            for item in plan.inputs:
                item.gen.record.poisoned = True
                self._finish(
                    item.gen,
                    FinishReason.ERROR,
                    GenerationError(f"executor failed: {type(exc).__name__}: {exc}"),
                )
            return
        observer = self.batch_observer
        if observer is not None:
            self._observe(observer, plan, time.perf_counter() - started)
        for item, out in zip(plan.inputs, outputs, strict=True):
            if not item.gen.finished:
                self._deliver(item, out)

    @staticmethod
    def _observe(observer: BatchObserver, plan: BatchPlan, seconds: float) -> None:
        try:
            observer(len(plan.inputs), sum(p.input.size() for p in plan.inputs), seconds)
        except Exception:  # metrics never fail a batch
            log.exception("batch observer failed")

    def _deliver(self, item: PlannedInput, out: ExecOutput) -> None:
        gen, rec = item.gen, item.gen.record
        if out.error is not None or (item.input.want_output and not out.tokens):
            rec.poisoned = True
            self._finish(
                gen, FinishReason.ERROR, GenerationError(out.error or "executor returned no prediction")
            )
            return
        # The input is committed; a continuing generation's pending token was its first position.
        rec.content.commit(item.input.start, item.input.tokens, item.input.size())
        rec.position = item.input.start + item.input.size()
        rec.pending = None
        if not item.decode:
            self.counts["prefill_positions"] += item.input.size()
        breakpoint = rec.position if rec.position in item.breakpoints else None
        if not item.input.want_output:
            self._emit(gen, GenerationUpdate((), rec.position, breakpoint=breakpoint))
            return
        if gen.first_token_at is None:
            gen.first_token_at = time.perf_counter()
        tokens, reason, rec.position, rec.pending = gen.accept(tuple(out.tokens), rec.position)
        logprobs = () if out.logprobs is None else tuple(out.logprobs[: len(tokens)])
        rec.content.extend(tokens[:-1])  # accepted drafts are committed; the last token is pending
        self.counts["tokens_decoded"] += len(tokens)
        if breakpoint is not None and breakpoint != rec.position:
            # Accepted speculative drafts moved the position past the breakpoint: report it on an
            # update of its own first, so an observer can still clone exactly there.
            self._emit(gen, GenerationUpdate((), breakpoint, breakpoint=breakpoint))
            if gen.finished:
                return
            breakpoint = None
        if reason is None and rec.position >= self.limits.max_session_tokens:
            reason = FinishReason.LENGTH  # the pending token has no room left in the session
        if reason is not None:
            self._finish(gen, reason, tokens=tokens, breakpoint=breakpoint, logprobs=logprobs)
        else:
            self._emit(gen, GenerationUpdate(tokens, rec.position, breakpoint=breakpoint, logprobs=logprobs))

    def _emit(self, gen: ActiveGeneration, update: GenerationUpdate) -> None:
        if gen.callback is None:
            return
        try:
            gen.callback(update)
        except Exception as exc:
            gen.callback = None  # a raising callback is not called again, not even for the end
            self._finish(
                gen, FinishReason.ERROR, GenerationError(f"callback raised {type(exc).__name__}: {exc}")
            )

    def _finish(
        self,
        gen: ActiveGeneration,
        reason: FinishReason,
        error: BaseException | None = None,
        *,
        tokens: tuple[int, ...] = (),
        breakpoint: int | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        """End ``gen`` once: free its session for the next generation, send the terminal update, settle."""
        if gen.finished:
            return
        gen.finished = True
        if gen in self._active:
            self._active.remove(gen)
        rec = gen.record
        if rec is not None and rec.generation is gen:
            rec.generation = None
            rec.busy = False
        self.counts["generations_finished"] += 1
        result = gen.result(reason, error)
        position = rec.position if rec is not None else 0
        if gen.callback is not None:
            update = GenerationUpdate(
                tokens,
                position,
                breakpoint=breakpoint,
                finished=True,
                finish_reason=reason,
                error=result.error,
                logprobs=logprobs,
            )
            try:
                gen.callback(update)
            except Exception as exc:
                error = GenerationError(f"callback raised {type(exc).__name__}: {exc}")
                result = gen.result(FinishReason.ERROR, error)
            except BaseException as exc:  # the engine thread dies of it: settle the caller first
                error = GenerationError(f"callback raised {type(exc).__name__}: {exc}")
                gen.handle._settle(gen.result(FinishReason.ERROR, error), error)
                raise
        gen.handle._settle(result, error)
        gen.callback = None  # the caller's handle keeps ``gen``; drop what it no longer needs
        gen.segments = []

    # ------------------------------------------------------------------ command handlers

    def _on_open(self, cmd: OpenCommand) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        sid = self._executor.open_session()
        if sid is None:
            cmd.future.set_exception(EngineFull(self.limits.max_sessions))
            return
        cmd.future.set_result(self._adopt(sid, ContentLog()))

    def _adopt(self, sid: int, content: ContentLog, pin: bool = False) -> Session:
        """Executor session ``sid`` as a runner Session holding ``content``; ``pin``: a clone or an
        import, whose export is then served off the engine thread (``SnapshotHandlers.pin``)."""
        key = self._next_key
        self._next_key += 1
        rec = SessionRecord(key=key, sid=sid, position=len(content), content=content)
        self.records[key] = rec
        if pin:
            self._snapshots.pin(rec)
        return Session(self._runner, rec)

    def _on_clone(self, cmd: CloneCommand) -> None:
        future = cmd.future_ref()
        if future is None or not future.set_running_or_notify_cancel():
            return  # abandoned before it ran: nobody could own the child, so none is made
        rec = self.records.get(cmd.key)
        refusal = self._clone_refusal(rec, cmd)
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
                child = self._adopt(sid, rec.content.prefix(cmd.upto), pin=True)
            else:
                refusal = (
                    CloneRefusal.WINDOW if cmd.upto < self._clone_floor(rec.sid) else CloneRefusal.BOUNDARY
                )
        self.counts["clones_succeeded" if child is not None else "clones_refused"] += 1
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

    @staticmethod
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

    def _on_close(self, cmd: CloseCommand) -> None:
        rec = self.records.get(cmd.key)
        if rec is None:
            return
        rec.closed, rec.pinned = True, None
        if rec.generation is not None:
            self._finish(rec.generation, FinishReason.CANCELLED)
        del self.records[cmd.key]
        try:
            self._executor.close_session(rec.sid)
        except Exception:
            log.exception("executor.close_session(%d) failed", rec.sid)

    def _on_start(self, cmd: StartCommand) -> None:
        gen = cmd.generation
        rec = self.records.get(cmd.key)
        self.counts["generations_started"] += 1
        if rec is None or rec.closed:
            self._finish(gen, FinishReason.ERROR, FailedPrecondition(f"session {cmd.key} is closed"))
            return
        if rec.poisoned or rec.generation is not None:
            state = "failed earlier" if rec.poisoned else "already generating"
            self._finish(gen, FinishReason.ERROR, FailedPrecondition(f"session {cmd.key} is {state}"))
            return
        gen.record = rec
        rec.pinned = None  # the generation writes the session: its export goes back to this thread
        rec.generation = gen
        rec.busy = True
        gen.started_at = time.perf_counter()
        problem = check_input(gen.input, rec, self.limits, self._executor)
        if problem is not None:
            self._finish(gen, FinishReason.ERROR, problem)
            return
        try:
            self._executor.set_sampling(rec.sid, SamplingParams.of(gen.config), gen.config.seed)
        except Exception as exc:
            self._finish(
                gen, FinishReason.ERROR, GenerationError(f"set_sampling failed: {type(exc).__name__}: {exc}")
            )
            return
        gen.segments = ([(rec.pending,)] if rec.pending is not None else []) + [gen.input]
        self._active.append(gen)

    def _on_cancel(self, cmd: CancelCommand) -> None:
        cmd.generation.cancel_requested = True

    # ------------------------------------------------------------------ shutdown

    def _teardown(self) -> None:
        with self.submit_lock:
            self.accepting = False  # from here on no future can be queued unsettled
        for gen in list(self._active):
            self._finish(gen, FinishReason.CANCELLED)
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
