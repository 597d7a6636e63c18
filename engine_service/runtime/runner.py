"""Runner: the public face of one engine thread (``EngineLoop``) that owns every session and executor
call; other threads queue commands and wait on futures. Callbacks run on the engine thread and may
queue commands but never wait on them (the waiting calls refuse to).
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
    # MLX aborts the process ("terminate called without an active exception") when a thread holding
    # MLX streams outlives the interpreter: stop every live engine thread, then release this thread's.
    for runner in list(_live_runners):
        runner.shutdown(timeout=10.0)
    clear_streams = getattr(mx, "clear_streams", None)  # MLX >= 0.32
    if clear_streams is not None:
        clear_streams()


@dataclass(frozen=True)
class RunnerMetrics:
    """Counters since the runner started, read without stopping the engine (``forward_batches``
    includes the failed ones; the last three are the load now)."""

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
    """Drives one :class:`Executor` from a dedicated engine thread; ``max_decode_sequences`` decode
    steps share a forward at most, one in which a prompt ends holds ``shared_batch_tokens`` positions
    at most. An executor that fails at start raises here."""

    def __init__(
        self,
        executor: Executor,
        *,
        max_decode_sequences: int = DEFAULTS.max_decode_sequences,
        shared_batch_tokens: int = DEFAULTS.shared_batch_tokens,
        name: str = "forkline-engine",
    ) -> None:
        max_decode_sequences = checked_int("max_decode_sequences", max_decode_sequences, lo=1)
        shared_batch_tokens = checked_int("shared_batch_tokens", shared_batch_tokens, lo=0)
        self._engine = EngineLoop(self, executor, max_decode_sequences, shared_batch_tokens)
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
        return self._engine.fingerprint

    @property
    def compute_path(self) -> str:
        """e.g. ``kernels q4_1 avx2 x2 threads, ...`` ("" when the executor runs no model)."""
        path = self._engine.compute_path
        return path.path if path is not None else ""

    @property
    def window_geometry(self) -> WindowGeometry | None:
        return self._engine.window_geometry

    @property
    def cache_kind(self) -> str:
        return self._engine.cache_kind

    @property
    def draft_counts(self) -> tuple[int, int]:
        """(draft tokens verified, accepted) since the start; (0, 0) without speculative decoding."""
        executor = self._engine._executor
        return int(getattr(executor, "drafted", 0)), int(getattr(executor, "accepted", 0))

    @property
    def draft_sources(self) -> dict[str, tuple[int, int]]:
        """Per draft source (lookup, suffix): (draft tokens verified, accepted); {} without drafts."""
        sources = getattr(self._engine._executor, "sources", {})
        return {name: (int(d), int(a)) for name, (d, a) in sources.items()}

    @property
    def draft_cost_ratio(self) -> float | None:
        """A forward's fixed cost over one more row's, as the speculative executor fits it (None: no drafts)."""
        costs = getattr(self._engine._executor, "step_costs", None)
        return None if costs is None else float(costs.ratio)

    @property
    def pins_exports(self) -> bool:
        return self._engine.pins_exports

    @property
    def slow_path(self) -> bool:
        """:attr:`compute_path` is far below this machine's best (logged at start)."""
        path = self._engine.compute_path
        return path is not None and path.slow

    @property
    def resident_sessions(self) -> int:
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
        """Called on the engine thread after every forward (``delivery.BatchObserver``); None: off."""
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
        """A future of a new idle session holding ``snapshot`` exactly, or of None with ``refusal`` /
        ``detail`` set; a refusal leaves the engine as it was."""
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
