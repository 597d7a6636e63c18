"""RunnerBackend: the prefix cache's backend over a local Runner (the CLI's in-process prefix cache and
snapshot folder). Handles are the Runner's Session objects."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING

from engine_service.api.answers import CloneRefusal, ImportedSnapshot, TakenClone
from engine_service.api.cache_kinds import clone_shared_share
from engine_service.sessions.session_files import encode_session, load_session_bytes

if TYPE_CHECKING:
    from engine_service.persistence.snapshot_key import SnapshotKey
    from engine_service.runtime.runner import Runner
    from engine_service.runtime.session import Session


class RunnerBackend:
    """Meets the cache's ``CaptureBackend`` and the tier's ``SnapshotBackend`` (a conformance test holds
    them together). ``clone`` waits for the engine (never call it from a generation callback);
    ``clone_async`` only queues. Snapshot files are signed and verified with ``key`` (``--snapshot_key``)."""

    def __init__(self, runner: Runner, *, key: SnapshotKey | None = None) -> None:
        self._runner = runner
        self._key = key

    @property
    def runner(self) -> Runner:
        return self._runner

    @property
    def fingerprint(self) -> str:
        return self._runner.fingerprint

    def clone(self, handle: Session, upto: int) -> Session | None:
        if not handle.valid:  # a dead session (closed, or its runner stopped): no engine call
            return None
        return handle.clone_async(upto).result()

    def clone_or_refusal(self, handle: Session, upto: int) -> TakenClone:
        if not handle.valid:
            return TakenClone(None, CloneRefusal.SOURCE_UNUSABLE)
        future = handle.clone_async(upto)
        child = future.result()
        return TakenClone(child, None if child is not None else getattr(future, "refusal", None))

    @property
    def max_rewind(self) -> int | None:
        window = self._runner.window_geometry
        return window.max_write if window is not None and window.evicts else None

    @property
    def clone_shared_share(self) -> float:
        limits = self._runner.limits
        return clone_shared_share(
            self._runner.cache_kind, limits.kv_bytes_per_position, limits.clone_shared_bytes_per_position
        )

    @property
    def clone_shared_ring_positions(self) -> int:
        return self._runner.limits.clone_shared_ring_positions

    def clone_async(self, handle: Session, upto: int) -> Future:
        return handle.clone_async(upto)

    def close(self, handle: Session) -> None:
        handle.close()

    def position(self, handle: Session) -> int:
        return handle.position

    def valid(self, handle: Session) -> bool:
        return handle.valid

    def content_digest(self, handle: Session) -> bytes | None:
        return handle.content_digest()  # read from the runner's record of the (idle) snapshot

    # -- snapshot files (the persistent tier's SnapshotBackend) ---------------------------------------
    def export_session(
        self, handle: Session, extra: Mapping[str, str], upto: int | None = None
    ) -> Iterator[bytes] | None:
        """The snapshot file of ``handle`` (positions ``[0, upto)``, default all; ``extra``: strings
        stored in it); None when refused."""
        encoded = encode_session(handle, extra=extra, key=self._key, upto=upto)
        return None if encoded.data is None else iter((encoded.data,))

    def import_session(self, chunks: Iterable[bytes]) -> ImportedSnapshot:
        """Load a snapshot file into a new session of this runner (every check of ``load_session``)."""
        outcome = load_session_bytes(self._runner, b"".join(chunks), key=self._key)
        if outcome.session is None:
            refusal = outcome.refusal.value if outcome.refusal is not None else ""
            return ImportedSnapshot(None, refusal, outcome.detail)
        return ImportedSnapshot(
            outcome.session,  # type: ignore[arg-type]  (a local handle is the Session itself)
            positions=outcome.positions,
            content_digest=outcome.session.content_digest(),
            extra=dict(outcome.extra),
        )
