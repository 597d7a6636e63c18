"""Runner: the public face of one engine thread that owns every session record and executor call.

Other threads only queue typed commands (:mod:`engine_service.runtime.commands`) and wait on futures and
generation handles; :class:`~engine_service.runtime.engine_loop.EngineLoop` is what runs on the thread::

    while not stopping: drain commands -> reap cancelled -> run one batch -> deliver outputs

Callbacks run on the engine thread. They may queue clones, cancels, closes and new generations, and
those run before the next forward; they must never wait on them (``open_session``, ``flush`` and
``GenerationHandle.wait`` refuse to, rather than deadlock). ``shutdown`` is idempotent: it finishes
live generations as cancelled, settles every future (queued clones resolve None without an executor
call, queued opens fail Unavailable) and closes every session.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import mlx.core as mx

from engine_service.api.answers import CloneRefusal
from engine_service.api.checks import checked_int
from engine_service.api.config import GenConfig
from engine_service.api.engine_info import WindowGeometry
from engine_service.api.errors import FailedPrecondition, InvalidArgument, Stopping
from engine_service.api.limits import EngineLimits
from engine_service.api.snapshot_files import LoadRefusal, SaveRefusal
from engine_service.executors.base import Executor
from engine_service.executors.options import DEFAULTS
from engine_service.executors.prepared_input import PreparedInput
from engine_service.model.compute_path import warn_if_slow
from engine_service.persistence.snapshot import SessionSnapshot
from engine_service.runtime.clone import CloneFuture
from engine_service.runtime.commands import (
    BarrierCommand,
    CancelCommand,
    CloneCommand,
    OpenCommand,
    StartCommand,
)
from engine_service.runtime.engine_loop import BatchObserver, EngineLoop
from engine_service.runtime.generation import GenerationHandle, GenerationUpdate
from engine_service.runtime.session import Session
from engine_service.runtime.snapshots import ExportCommand, ExportFuture, ImportCommand, ImportFuture
from engine_service.runtime.state import ActiveGeneration

log = logging.getLogger(__name__)

# Runners whose engine thread may still be alive; stopped at interpreter exit (see below).
_live_runners: weakref.WeakSet[Runner] = weakref.WeakSet()


@atexit.register
def _stop_live_runners_at_exit() -> None:
    """A process that exits without ``shutdown()`` must not abort: MLX terminates the process ("terminate
    called without an active exception") when a thread still holding MLX streams outlives the
    interpreter. So stop every live engine thread, then release this (main) thread's streams."""
    for runner in list(_live_runners):
        runner.shutdown(timeout=10.0)
    clear_streams = getattr(mx, "clear_streams", None)  # MLX >= 0.32
    if clear_streams is not None:
        clear_streams()


@dataclass(frozen=True)
class RunnerMetrics:
    """Counters since the runner started (a snapshot, read without stopping the engine).

    steps: engine loop iterations (each drains the inbox, then runs at most one forward).
    forward_batches: executor.execute calls, failed ones included (also counted in failed_batches).
    tokens_decoded: tokens returned to generations. prefill_positions: prompt positions committed.
    resident_sessions: sessions the executor holds now. active_generations: generations the engine
    thread runs now. queued_commands: commands (opens, clones, closes, starts, ...) waiting in its inbox.
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
    active_generations: int = 0
    queued_commands: int = 0


class Runner:
    """Drives one :class:`Executor` from a dedicated engine thread.

    max_decode_sequences: most sequences whose decode step is packed into one forward; prefill chunks
        fill the rest of the batch up to ``executor.preferred_batch_tokens()`` positions.
    The executor's ``limits()`` and ``fingerprint()`` are read once, on the engine thread, at start;
    an exception there is raised by the constructor.
    """

    def __init__(
        self,
        executor: Executor,
        *,
        max_decode_sequences: int = DEFAULTS.max_decode_sequences,
        name: str = "forkline-engine",
    ) -> None:
        max_decode_sequences = checked_int("max_decode_sequences", max_decode_sequences, lo=1)
        self._engine = EngineLoop(self, executor, max_decode_sequences)
        self._thread = threading.Thread(target=self._engine.run, name=name, daemon=True)
        self._thread.start()
        _live_runners.add(self)
        self._engine.ready.wait()
        if self._engine.startup_error is not None:
            raise self._engine.startup_error
        if self._engine.compute_path is not None:
            log.info("engine %r compute path: %s", name, self._engine.compute_path.path)
            warn_if_slow(self._engine.compute_path, log, f"engine {name!r}")

    @property
    def engine_thread(self) -> threading.Thread:
        return self._thread

    @property
    def running(self) -> bool:
        return self._engine.accepting and not self._engine.stop_requested

    @property
    def limits(self) -> EngineLimits:
        assert self._engine.limits is not None
        return self._engine.limits

    @property
    def fingerprint(self) -> str:
        """The executor's fingerprint (model + execution configuration): part of prefix-cache keys."""
        return self._engine.fingerprint

    @property
    def compute_path(self) -> str:
        """The compute path the executor runs on, e.g. ``kernels q4_1 avx2 x2 threads, openblas float32
        above 64 rows`` or ``reference BLAS float32`` ("" when the executor runs no model)."""
        path = self._engine.compute_path
        return path.path if path is not None else ""

    @property
    def window_geometry(self) -> WindowGeometry | None:
        """What clones of this executor's sessions can reach on sliding-window layers
        (``executors.base.WindowGeometry``; None when the executor does not say)."""
        return self._engine.window_geometry

    @property
    def pins_exports(self) -> bool:
        """Whether a clone's or an import's export is served off the engine thread until it generates
        (``Session.export_async``; ``Executor.pins_exports``)."""
        return self._engine.pins_exports

    @property
    def slow_path(self) -> bool:
        """Whether :attr:`compute_path` is far below this machine's best (a WARNING at start says how
        to fix it)."""
        path = self._engine.compute_path
        return path is not None and path.slow

    @property
    def resident_sessions(self) -> int:
        """Sessions the executor holds now (opened or cloned, not yet closed)."""
        return len(self._engine.records)

    def metrics(self) -> RunnerMetrics:
        engine = self._engine
        return RunnerMetrics(
            **engine.counts,
            resident_sessions=len(engine.records),
            active_generations=engine.active_generations,
            queued_commands=engine.inbox.qsize(),
        )

    @property
    def batch_observer(self) -> BatchObserver | None:
        """Called on the engine thread after every forward with (rows, positions, seconds of
        ``executor.execute``); must be cheap and should not raise (an exception is logged, never fails
        the batch). None (the default): nothing is called."""
        return self._engine.batch_observer

    @batch_observer.setter
    def batch_observer(self, observer: BatchObserver | None) -> None:
        self._engine.batch_observer = observer

    def open_session_async(self) -> Future[Session]:
        """A future of a new empty session; fails ResourceExhausted (no slot) or Unavailable (stopping)."""
        future: Future[Session] = Future()
        if not self._engine.put(OpenCommand(future)):
            future.set_exception(Stopping("runner is stopping"))
        return future

    def open_session(self, timeout: float | None = None) -> Session:
        """A new empty session. Raises ResourceExhausted, Unavailable; refused from a callback."""
        self._refuse_on_engine_thread("open_session")
        return self.open_session_async().result(timeout)

    def import_async(self, snapshot: SessionSnapshot) -> ImportFuture:
        """A future of a new idle session holding ``snapshot`` exactly (K/V, ring state, content), or
        of None with ``refusal`` / ``detail`` set: another cache kind, geometry or fingerprint, arrays
        that do not fit, more positions than ``max_session_tokens``, no room, or stopping. Everything
        is checked on the engine thread before the executor allocates anything; a refusal leaves the
        engine as it was. Dropping the future before it runs skips the import. Usable from callbacks
        (never wait on it there). Reading a file: :func:`engine_service.sessions.session_files.load_session`.
        """
        if not isinstance(snapshot, SessionSnapshot):
            raise InvalidArgument(f"snapshot must be a SessionSnapshot, got {type(snapshot).__name__}")
        future = ImportFuture()
        if not self._engine.put(ImportCommand(snapshot, weakref.ref(future))):
            future.refuse(LoadRefusal.STOPPING, "the runner is stopping")
        return future

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every command queued before this call has been handled (no-op once stopped)."""
        self._refuse_on_engine_thread("flush")
        future: Future[None] = Future()
        if self._engine.put(BarrierCommand(future)):
            future.result(timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine and wait for it (idempotent). From a callback it only requests the stop."""
        self._engine.stop_requested = True
        if threading.current_thread() is self._thread:
            return
        self._engine.inbox.put(BarrierCommand())  # wakes an idle engine
        self._thread.join(timeout)

    def _refuse_on_engine_thread(self, what: str) -> None:
        if threading.current_thread() is self._thread:
            raise FailedPrecondition(
                f"{what} would wait for the engine thread itself; "
                "queue work from a callback, never wait for it there"
            )

    # ------------------------------------------------------------------ used by Session

    @property
    def _inbox(self):
        return self._engine.inbox

    def _submit(self, command: object, future: Future | None) -> None:
        """Queue ``command``; when stopping, fail ``future`` (or raise Unavailable without one)."""
        if not self._engine.put(command):
            if future is None:
                raise Stopping("runner is stopping")
            future.set_exception(Stopping("runner is stopping"))

    def _start(
        self,
        session: Session,
        input: tuple[int, ...] | PreparedInput,
        config: GenConfig,
        callback: Callable[[GenerationUpdate], None] | None,
    ) -> GenerationHandle:
        gen: ActiveGeneration | None = None
        inbox = self._engine.inbox
        handle = GenerationHandle(session, lambda: inbox.put(CancelCommand(gen)))
        gen = ActiveGeneration(handle=handle, config=config, callback=callback, input=input)
        self._submit(StartCommand(session.key, gen), None)
        return handle

    def _export(self, key: int, upto: int | None = None) -> ExportFuture:
        future = ExportFuture()
        if not self._engine.put(ExportCommand(key, future, upto)):
            future.refuse(SaveRefusal.STOPPING)
        return future

    def _clone(self, key: int, upto: int, expected_digest: bytes | None = None) -> CloneFuture:
        future = CloneFuture()
        if not self._engine.put(CloneCommand(key, upto, weakref.ref(future), expected_digest)):
            future.refuse(CloneRefusal.STOPPING)
        return future
