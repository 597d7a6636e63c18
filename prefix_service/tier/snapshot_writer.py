"""SnapshotWriter: one background thread exporting stored snapshots from their engines into the
:class:`SnapshotStore`, behind the request path; a full queue drops (and counts) a job, never waits."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from engine_service.api.errors import ForklineError
from prefix_service.tier.snapshot_store import SnapshotStore, extra_for

log = logging.getLogger(__name__)

DEFAULT_QUEUE = 32


@dataclass(frozen=True)
class WriteJob:
    """Persist the snapshot ``handle`` holding ``tokens`` (under ``namespace``), exported by ``export``
    (``export(handle, extra)`` -> the file's chunks, or None when the engine refused)."""

    fingerprint: str
    namespace: str
    tokens: tuple[int, ...]
    metadata: Mapping[str, str]
    handle: object
    export: Callable[[object, Mapping[str, str]], Iterable[bytes] | None] = field(repr=False)


class SnapshotWriter:
    """See the module docstring."""

    def __init__(self, store: SnapshotStore, queue_size: int = DEFAULT_QUEUE) -> None:
        self.store = store
        self._queue: queue.Queue[WriteJob | None] = queue.Queue(maxsize=max(1, queue_size))
        self._stopped = threading.Event()
        self._idle = threading.Condition()
        self._busy = 0
        self._thread = threading.Thread(target=self._run, name="forkline-snapshot-writer", daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob) -> bool:
        """Queue ``job`` unless the folder already holds its key; False when dropped (queue full, stopped)."""
        if self.store.holds(job.fingerprint, job.namespace, job.tokens):
            return True
        if self._stopped.is_set():
            self.store.count("dropped")
            return False
        with self._idle:
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self.store.count("dropped")
                return False
            self._busy += 1
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is done; False on timeout (tests, a clean shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the job in progress, drop the queued ones, end the thread (idempotent)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self.store.count("dropped")
                self._done()
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            finally:
                self._done()

    def _write(self, job: WriteJob) -> None:
        try:
            chunks = job.export(job.handle, extra_for(job.namespace, job.tokens, job.metadata))
            if chunks is None or not self.store.write(
                job.fingerprint, job.namespace, job.tokens, job.metadata, chunks
            ):
                self.store.count("failed")
        except (ForklineError, OSError) as exc:  # the handle is gone, the engine refused, the disk is full
            log.info("snapshot dir: not written (%s)", exc)
            self.store.count("failed")
        except Exception:  # noqa: BLE001 - the writer thread must outlive any one job
            log.warning("snapshot dir: write failed", exc_info=True)
            self.store.count("failed")

    def _done(self) -> None:
        with self._idle:
            self._busy -= 1
            self._idle.notify_all()
