"""Session: the caller's handle on one executor session owned by the runner's engine thread; it only
queues commands and reads the committed position, and closes when garbage-collected."""

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
    """A resident session (made by the runner): generate on it, one generation at a time; clone,
    export or close it. The pending prediction is fed first by the next generation."""

    def __init__(self, runner: Runner, record: SessionRecord) -> None:
        self._runner = runner
        self._record = record
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, runner._inbox.put, CloseCommand(record.key))

    @property
    def key(self) -> int:
        return self._record.key

    @property
    def position(self) -> int:
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
        """Start a generation; returns at once. ``callback`` runs on the engine thread for every
        update and may queue commands, never wait on them. FailedPrecondition (closed, poisoned, busy),
        Unavailable (stopping); bad input content fails the returned handle instead."""
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
        """A future of a new idle session holding exactly ``[0, upto)``, or of None with ``refusal``
        set; with ``expected_digest``, only when that range holds those tokens (checked on the engine
        thread). Dropping the future before it runs skips the clone."""
        upto = checked_int("upto", upto)
        if expected_digest is not None and (
            not isinstance(expected_digest, bytes) or len(expected_digest) != DIGEST_SIZE
        ):
            raise InvalidArgument(f"expected_digest must be {DIGEST_SIZE} bytes, got {expected_digest!r}")
        if self._closed or self._record.poisoned:
            return CloneFuture.refused(CloneRefusal.SOURCE_UNUSABLE)
        return self._runner._clone(self._record.key, upto, expected_digest)

    def export_async(self, upto: int | None = None) -> ExportFuture:
        """A future of a ``SessionSnapshot`` of ``[0, upto)`` (default: the committed positions), or of
        None with ``refusal`` set. The session is unchanged."""
        if upto is not None:
            upto = checked_int("upto", upto, lo=0)
        if self._closed or self._record.poisoned:
            future = ExportFuture()
            future.refuse(SaveRefusal.SOURCE_UNUSABLE)
            return future
        pinned = self._record.pinned
        if pinned is not None:  # a clone or import not generated since: copied here, off the engine thread
            return pinned.export(pinned.state.length if upto is None else upto)
        return self._runner._export(self._record.key, upto)

    def content_digest(self, upto: int | None = None) -> bytes | None:
        """``content_digest`` of the ids in ``[0, upto)`` (None: a prepared input in range); ask an
        idle session, the content changes while it generates. InvalidArgument outside ``[0, position]``."""
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
