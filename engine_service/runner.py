"""Runner: one engine thread that owns every session record and every executor call.

Other threads only put typed commands (:mod:`engine_service.commands`) on the inbox and wait on
futures / generation handles. The engine loop reads like a sentence::

    while not stopping: drain commands -> reap cancelled -> run one batch -> deliver outputs

Commands queued by an output callback are drained before the next forward, so a clone requested from
a callback sees exactly the state that callback saw. With no live generation the thread blocks on the
inbox (no busy spin). ``shutdown`` finishes live generations as cancelled, settles every queued
future (clones resolve None without an executor call) and closes every session.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from engine_service.batch_plan import BatchPlan, PlannedInput, plan_batch
from engine_service.commands import (
    BarrierCommand,
    CancelCommand,
    CloneCommand,
    CloseCommand,
    CommandTable,
    OpenCommand,
    StartCommand,
)
from engine_service.config import GenConfig
from engine_service.errors import FailedPrecondition, GenerationError, ResourceExhausted, Unavailable
from engine_service.executor import Executor, ExecutorLimits
from engine_service.generation import GenerationHandle, GenerationUpdate
from engine_service.input_check import check_input
from engine_service.prepared_input import PreparedInput
from engine_service.session import Session
from engine_service.session_record import CANCELLED, ERROR, LENGTH, ActiveGeneration, SessionRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerMetrics:
    """Counters since the runner started (a snapshot; read without stopping the engine).

    steps: engine loop iterations. forward_batches: executor.execute calls (failed ones included).
    tokens_decoded: tokens returned to generations. prefill_positions: prompt positions fed.
    """

    steps: int = 0
    forward_batches: int = 0
    failed_batches: int = 0
    tokens_decoded: int = 0
    prefill_positions: int = 0
    generations_started: int = 0
    generations_finished: int = 0
    clones_succeeded: int = 0
    clones_refused: int = 0
    resident_sessions: int = 0


class Runner:
    """Drives one :class:`Executor` from a dedicated engine thread.

    max_decode_sequences: most sequences whose decode step is packed into one forward; prefill chunks
        fill the rest of the batch up to ``executor.preferred_batch_tokens()`` positions.
    """

    def __init__(self, executor: Executor, *, max_decode_sequences: int = 8, name: str = "forkline-engine") -> None:
        if max_decode_sequences < 1:
            raise ValueError(f"max_decode_sequences must be >= 1, got {max_decode_sequences}")
        self._executor = executor
        self._max_decode = max_decode_sequences
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Guards the accepting flag against submissions racing the final drain at shutdown.
        self._submit_lock = threading.Lock()
        self._accepting = True
        self._stop_requested = False
        self._records: dict[int, SessionRecord] = {}
        self._active: list[ActiveGeneration] = []
        self._next_key = 0
        self._counts: dict[str, int] = dict.fromkeys(RunnerMetrics.__dataclass_fields__, 0)
        self._table = CommandTable({
            OpenCommand: self._on_open,
            CloneCommand: self._on_clone,
            CloseCommand: self._on_close,
            StartCommand: self._on_start,
            CancelCommand: self._on_cancel,
            BarrierCommand: self._on_barrier,
        })
        self._limits: ExecutorLimits | None = None
        self._fingerprint = ""
        self._startup_error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    # ------------------------------------------------------------------ public API (any thread)

    @property
    def engine_thread(self) -> threading.Thread:
        return self._thread

    @property
    def running(self) -> bool:
        return self._accepting and not self._stop_requested

    @property
    def limits(self) -> ExecutorLimits:
        assert self._limits is not None
        return self._limits

    @property
    def fingerprint(self) -> str:
        """The executor's fingerprint (model + execution configuration), read once at start."""
        return self._fingerprint

    @property
    def resident_sessions(self) -> int:
        """Sessions the executor holds now (open, cloned and not yet closed)."""
        return len(self._records)

    def metrics(self) -> RunnerMetrics:
        counts = dict(self._counts)
        counts["resident_sessions"] = len(self._records)
        return RunnerMetrics(**counts)

    def open_session_async(self) -> Future[Session]:
        """A future of a new empty session (ResourceExhausted when no slot is free)."""
        future: Future[Session] = Future()
        self._submit(OpenCommand(future), future)
        return future

    def open_session(self, timeout: float | None = None) -> Session:
        """A new empty session. Raises ResourceExhausted, Unavailable; not callable from a callback."""
        if threading.current_thread() is self._thread:
            raise FailedPrecondition("open_session would wait for the engine thread itself; "
                                     "use open_session_async from a callback")
        return self.open_session_async().result(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every command queued before this call has been handled."""
        if threading.current_thread() is self._thread:
            raise FailedPrecondition("flush would wait for the engine thread itself")
        future: Future[None] = Future()
        self._submit(BarrierCommand(future), future)
        future.result(timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine (idempotent). From a callback it only requests the stop."""
        self._stop_requested = True
        if threading.current_thread() is self._thread:
            return
        self._inbox.put(BarrierCommand())  # wakes an idle engine
        self._thread.join(timeout)

    # ------------------------------------------------------------------ used by Session

    def _submit(self, command: object, future: Future | None) -> None:
        with self._submit_lock:
            if not self._accepting or self._stop_requested:
                if future is None:
                    raise Unavailable("runner is stopping")
                future.set_exception(Unavailable("runner is stopping"))
                return
            if not self._table.handles(command):
                raise TypeError(f"unknown command {type(command).__name__}")
            self._inbox.put(command)

    def _start(self, session: Session, input: tuple[int, ...] | PreparedInput, config: GenConfig,
               callback: Callable[[GenerationUpdate], None] | None) -> GenerationHandle:
        gen: ActiveGeneration | None = None
        handle = GenerationHandle(session, lambda: self._inbox.put(CancelCommand(gen)))
        gen = ActiveGeneration(handle=handle, config=config, callback=callback, input=input)
        with self._submit_lock:
            if not self._accepting or self._stop_requested:
                raise Unavailable("runner is stopping")
            self._inbox.put(StartCommand(session.key, gen))
        return handle

    def _clone(self, key: int, upto: int) -> Future[Session | None]:
        future: Future[Session | None] = Future()
        with self._submit_lock:
            if not self._accepting or self._stop_requested:
                future.set_result(None)
            else:
                self._inbox.put(CloneCommand(key, upto, weakref.ref(future)))
        return future

    # ------------------------------------------------------------------ engine thread

    def _main(self) -> None:
        try:
            self._limits = self._executor.limits()
            self._fingerprint = self._executor.fingerprint()
        except BaseException as exc:  # reported to the constructor's thread
            self._startup_error = exc
            self._accepting = False
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop_requested:
                self._counts["steps"] += 1
                self._drain(block=not self._active)
                if self._stop_requested:
                    break
                self._reap_cancelled()
                self._step()
        finally:
            self._teardown()

    def _drain(self, *, block: bool) -> None:
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._dispatch(command)
            if self._stop_requested:
                return
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, command: object) -> None:
        try:
            self._table.dispatch(command)
        except Exception as exc:  # a handler bug must not take the engine down; settle the caller
            log.exception("command %s failed", type(command).__name__)
            future = getattr(command, "future", None)
            if future is not None and not future.done():
                future.set_exception(exc)
            gen = getattr(command, "generation", None)
            if gen is not None:
                self._finish(gen, ERROR, GenerationError(f"{type(exc).__name__}: {exc}"))

    def _reap_cancelled(self) -> None:
        for gen in [g for g in self._active if g.cancel_requested]:
            self._finish(gen, CANCELLED)

    def _step(self) -> None:
        # A method, not inline in the loop: the plan must not stay referenced while the engine idles
        # (it holds generation handles, which hold sessions that would then never be collected).
        plan = plan_batch(self._active, self._max_decode, self._executor.preferred_batch_tokens(),
                          self._counts["steps"])
        if plan.inputs:
            self._run_batch(plan)

    def _run_batch(self, plan: BatchPlan) -> None:
        self._counts["forward_batches"] += 1
        try:
            outputs = self._executor.execute([p.input for p in plan.inputs])
            if len(outputs) != len(plan.inputs):
                raise GenerationError(f"executor returned {len(outputs)} outputs for {len(plan.inputs)} inputs")
        except Exception as exc:
            # A failed batch poisons every session in it; other sessions and the engine carry on.
            self._counts["failed_batches"] += 1
            log.warning("batch of %d inputs failed: %s", len(plan.inputs), exc)
            for item in plan.inputs:
                item.gen.record.poisoned = True
                self._finish(item.gen, ERROR, GenerationError(f"executor failed: {type(exc).__name__}: {exc}"))
            return
        for item, out in zip(plan.inputs, outputs, strict=True):
            if not item.gen.finished:
                self._deliver(item, out)

    def _deliver(self, item: PlannedInput, out) -> None:
        gen, rec = item.gen, item.gen.record
        if out.error is not None or (item.input.want_output and not out.tokens):
            rec.poisoned = True
            self._finish(gen, ERROR, GenerationError(out.error or "executor returned no prediction"))
            return
        # The input is committed; a continuing generation's pending token was its first position.
        rec.position = item.input.start + item.input.size()
        rec.pending = None
        if not item.decode:
            self._counts["prefill_positions"] += item.input.size()
        breakpoint = rec.position if rec.position in item.breakpoints else None
        if not item.input.want_output:
            self._emit(gen, GenerationUpdate((), rec.position, breakpoint=breakpoint))
            return
        if gen.first_token_at is None:
            gen.first_token_at = time.perf_counter()
        tokens, reason, rec.position, rec.pending = gen.accept(tuple(out.tokens), rec.position)
        self._counts["tokens_decoded"] += len(tokens)
        if breakpoint != rec.position:
            breakpoint = None
        if reason is None and rec.position >= self.limits.max_session_tokens:
            reason = LENGTH  # the pending token has no room left in the session
        if reason is not None:
            self._finish(gen, reason, tokens=tokens, breakpoint=breakpoint)
        else:
            self._emit(gen, GenerationUpdate(tokens, rec.position, breakpoint=breakpoint))

    def _emit(self, gen: ActiveGeneration, update: GenerationUpdate) -> None:
        if gen.callback is None:
            return
        try:
            gen.callback(update)
        except Exception as exc:
            gen.callback = None  # a raising callback is not called again, not even for the end
            self._finish(gen, ERROR, GenerationError(f"callback raised {type(exc).__name__}: {exc}"))

    def _finish(self, gen: ActiveGeneration, reason: str, error: BaseException | None = None, *,
                tokens: tuple[int, ...] = (), breakpoint: int | None = None) -> None:
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
        self._counts["generations_finished"] += 1
        result = gen.result(reason, error)
        position = rec.position if rec is not None else 0
        if gen.callback is not None:
            update = GenerationUpdate(tokens, position, breakpoint=breakpoint, finished=True,
                                      finish_reason=reason, error=result.error)
            try:
                gen.callback(update)
            except Exception as exc:
                error = GenerationError(f"callback raised {type(exc).__name__}: {exc}")
                result = gen.result(ERROR, error)
        gen.handle._settle(result, error)

    # ------------------------------------------------------------------ command handlers

    def _on_open(self, cmd: OpenCommand) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        sid = self._executor.open_session()
        if sid is None:
            cmd.future.set_exception(ResourceExhausted(
                f"no free session slot (max_sessions={self.limits.max_sessions})"))
            return
        cmd.future.set_result(self._adopt(sid, position=0))

    def _adopt(self, sid: int, position: int) -> Session:
        key = self._next_key
        self._next_key += 1
        rec = SessionRecord(key=key, sid=sid, position=position)
        self._records[key] = rec
        return Session(self, rec)

    def _on_clone(self, cmd: CloneCommand) -> None:
        future = cmd.future_ref()
        if future is None or not future.set_running_or_notify_cancel():
            return  # abandoned before it ran: nobody could own the child, so none is made
        rec = self._records.get(cmd.key)
        child: Session | None = None
        # Only the runner's accepted position authorizes a clone: a speculative executor may have
        # physically written past it, and the pending token is not written at all.
        if rec is not None and not rec.poisoned and 0 <= cmd.upto <= rec.position:
            try:
                sid = self._executor.clone(rec.sid, cmd.upto)
            except Exception as exc:  # an exception inside clone is a refusal
                log.warning("executor.clone(%d, %d) raised %s: %s", rec.sid, cmd.upto, type(exc).__name__, exc)
                sid = None
            if sid is not None:
                child = self._adopt(sid, position=cmd.upto)
        self._counts["clones_succeeded" if child is not None else "clones_refused"] += 1
        future.set_result(child)

    def _on_close(self, cmd: CloseCommand) -> None:
        rec = self._records.get(cmd.key)
        if rec is None:
            return
        rec.closed = True
        if rec.generation is not None:
            self._finish(rec.generation, CANCELLED)
        del self._records[cmd.key]
        try:
            self._executor.close_session(rec.sid)
        except Exception:
            log.exception("executor.close_session(%d) failed", rec.sid)

    def _on_start(self, cmd: StartCommand) -> None:
        gen = cmd.generation
        rec = self._records.get(cmd.key)
        self._counts["generations_started"] += 1
        if rec is None or rec.closed:
            self._finish(gen, ERROR, FailedPrecondition(f"session {cmd.key} is closed"))
            return
        if rec.poisoned or rec.generation is not None:
            state = "failed earlier" if rec.poisoned else "already generating"
            self._finish(gen, ERROR, FailedPrecondition(f"session {cmd.key} is {state}"))
            return
        gen.record = rec
        rec.generation = gen
        rec.busy = True
        gen.started_at = time.perf_counter()
        problem = check_input(gen.input, rec, self.limits, self._executor)
        if problem is not None:
            self._finish(gen, ERROR, problem)
            return
        try:
            self._executor.set_sampling(rec.sid, gen.config.sampling(), gen.config.seed)
        except Exception as exc:
            self._finish(gen, ERROR, GenerationError(f"set_sampling failed: {type(exc).__name__}: {exc}"))
            return
        gen.segments = ([(rec.pending,)] if rec.pending is not None else []) + [gen.input]
        self._active.append(gen)

    def _on_cancel(self, cmd: CancelCommand) -> None:
        cmd.generation.cancel_requested = True

    def _on_barrier(self, cmd: BarrierCommand) -> None:
        if cmd.future is not None and cmd.future.set_running_or_notify_cancel():
            cmd.future.set_result(None)

    # ------------------------------------------------------------------ shutdown

    def _teardown(self) -> None:
        with self._submit_lock:
            self._accepting = False  # from here on no future can be queued unsettled
        for gen in list(self._active):
            self._finish(gen, CANCELLED)
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            try:
                self._settle_unrun(command)
            except Exception:
                log.exception("settling %s at shutdown failed", type(command).__name__)
        for rec in list(self._records.values()):
            rec.closed = True
            try:
                self._executor.close_session(rec.sid)
            except Exception:
                log.exception("executor.close_session(%d) failed at shutdown", rec.sid)
        self._records.clear()

    def _settle_unrun(self, command: object) -> None:
        """Settle a command queued when the engine stopped, without calling the executor for it."""
        if isinstance(command, OpenCommand):
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(Unavailable("runner is stopping"))
        elif isinstance(command, CloneCommand):
            future = command.future_ref()
            if future is not None and future.set_running_or_notify_cancel():
                self._counts["clones_refused"] += 1
                future.set_result(None)
        elif isinstance(command, StartCommand):
            self._finish(command.generation, CANCELLED)
        elif isinstance(command, (CloseCommand, BarrierCommand)):
            self._table.dispatch(command)
        # CancelCommand: its generation already ended.
