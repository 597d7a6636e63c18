"""Session: the caller's handle on one executor session owned by the runner's engine thread.

A Session never touches the executor. It queues commands (start, clone, close) on its runner's inbox
and reads the engine-maintained committed position. It is a context manager and also closes when
garbage-collected: a ``weakref.finalize`` puts a CloseCommand on the inbox (a ``queue.SimpleQueue``,
whose ``put`` is reentrant, so a finalizer running inside another inbox operation cannot deadlock).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine_service.api.answers import CloneRefusal
from engine_service.api.checks import checked_int
from engine_service.api.config import GenConfig, int_tuple
from engine_service.api.content import DIGEST_SIZE
from engine_service.api.errors import FailedPrecondition, InvalidArgument
from engine_service.api.snapshot_files import SaveRefusal
from engine_service.executors.prepared_input import PreparedInput
from engine_service.runtime.clone import CloneFuture
from engine_service.runtime.commands import CloseCommand
from engine_service.runtime.generation import GenerationHandle, GenerationUpdate
from engine_service.runtime.snapshots import ExportFuture
from engine_service.runtime.state import SessionRecord

if TYPE_CHECKING:
    from engine_service.runtime.runner import Runner


class Session:
    """A resident session: generate on it, clone it at a committed boundary, close it.

    Created only by the runner (``runner.open_session()`` or a clone future). ``position`` is the
    committed position; the pending prediction of the last generation is excluded and is fed first
    by the next generation. One generation at a time.
    """

    def __init__(self, runner: Runner, record: SessionRecord) -> None:
        self._runner = runner
        self._record = record
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, runner._inbox.put, CloseCommand(record.key))

    @property
    def key(self) -> int:
        """Runner-local id of this session (stable, never reused by the runner)."""
        return self._record.key

    @property
    def position(self) -> int:
        """Committed positions (the pending token excluded)."""
        return self._record.position

    @property
    def has_pending(self) -> bool:
        """Whether a pending prediction will be fed first by the next generation."""
        return self._record.pending is not None

    @property
    def valid(self) -> bool:
        """Open, not poisoned by a failed batch, and the runner is running."""
        return not self._closed and not self._record.poisoned and self._runner.running

    @property
    def _closed(self) -> bool:
        """Closed by the caller (its close queued) or by the engine."""
        return not self._finalizer.alive or self._record.closed

    @property
    def generating(self) -> bool:
        return self._record.busy

    def generate_async(
        self,
        input: Sequence[int] | PreparedInput,
        config: GenConfig | None = None,
        callback: Callable[[GenerationUpdate], None] | None = None,
    ) -> GenerationHandle:
        """Start a generation; returns at once.

        ``callback`` runs on the engine thread for every update (prefill chunks, tokens, breakpoints,
        and exactly one terminal update). It may queue clones, cancels and closes, never wait on them.
        Raises FailedPrecondition when this session is closed, poisoned or already generating, and
        Unavailable when the runner is stopping. Bad input content (empty, token ids outside the
        vocabulary, too long, an unsupported prepared kind) fails the returned handle instead.
        """
        config = GenConfig() if config is None else config
        if not isinstance(config, GenConfig):
            raise InvalidArgument(f"config must be a GenConfig, got {type(config).__name__}")
        if not isinstance(input, PreparedInput):
            input = int_tuple("input", input)
        with self._lock:
            rec = self._record
            if self._closed:
                raise FailedPrecondition(f"session {rec.key} is closed")
            if rec.poisoned:
                raise FailedPrecondition(f"session {rec.key} failed earlier and cannot generate")
            if rec.busy:
                raise FailedPrecondition(f"session {rec.key} is already generating")
            rec.busy = True
            try:
                return self._runner._start(self, input, config, callback)
            except BaseException:
                rec.busy = False
                raise

    def clone_async(self, upto: int, expected_digest: bytes | None = None) -> CloneFuture:
        """A future of a new idle session holding exactly positions ``[0, upto)``, or of None.

        None when cloning is unsupported, ``upto`` is outside ``[0, position]`` when the engine runs
        the clone, the source is closed or failed, resources are exhausted, or the runner stops. A
        closed session resolves None at once. Dropping or cancelling the future before it completes
        skips the clone; dropping a completed future's session closes it (garbage collection).

        ``expected_digest`` (a ``content_digest`` of token ids): clone only when ``[0, upto)`` holds
        exactly those tokens, checked on the engine thread when the clone runs (no generation can
        change the range in between). A range holding a prepared input never matches. The returned
        :class:`CloneFuture`'s ``refusal`` says why it resolved None (``CloneRefusal``); a refused
        clone never changes this session.
        """
        upto = checked_int("upto", upto)
        if expected_digest is not None and (
            not isinstance(expected_digest, bytes) or len(expected_digest) != DIGEST_SIZE
        ):
            raise InvalidArgument(f"expected_digest must be {DIGEST_SIZE} bytes, got {expected_digest!r}")
        if self._closed or self._record.poisoned:
            return CloneFuture.refused(CloneRefusal.SOURCE_UNUSABLE)
        return self._runner._clone(self._record.key, upto, expected_digest)

    def export_async(self, upto: int | None = None) -> ExportFuture:
        """A future of a :class:`~engine_service.persistence.snapshot.SessionSnapshot` of this session's
        positions ``[0, upto)`` (default: all committed positions; the pending prediction excluded), or
        of None with ``refusal`` set (closed or failed, ``upto`` past the committed positions or below a
        ring's floor, a prepared input in range, unsupported, stopping). The session is unchanged.

        A clone or an import that has not generated yet is pinned (``SessionRecord.pinned``): its
        export is copied here, on the calling thread, without waiting for the engine thread's running
        forward; any other session's is taken on the engine thread between two forwards. Writing it to
        a file: :func:`engine_service.sessions.session_files.save_session`.
        """
        if upto is not None:
            upto = checked_int("upto", upto, lo=0)
        if self._closed or self._record.poisoned:
            future = ExportFuture()
            future.refuse(SaveRefusal.SOURCE_UNUSABLE)
            return future
        pinned = self._record.pinned
        if pinned is not None:
            return pinned.export(pinned.state.length if upto is None else upto)
        return self._runner._export(self._record.key, upto)

    def content_digest(self, upto: int | None = None) -> bytes | None:
        """The content digest of positions ``[0, upto)`` (default: all committed positions), as
        ``content.content_digest`` of the token ids they hold; None when a prepared input lies in range.

        Read on the calling thread from one atomic copy of the engine's record, so ask an idle session
        (a snapshot, a session between generations): while a generation runs, the content changes.
        InvalidArgument when ``upto`` is outside ``[0, position]``.
        """
        return self._record.content.digest(upto)

    def close(self) -> None:
        """Queue this session's close (idempotent); a running generation ends as cancelled."""
        self._finalizer()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self.valid else "closed"
        return f"Session(key={self.key}, position={self.position}, {state})"
