"""ExportSession / ImportSession for one owner: a session as a snapshot file's bytes and back, so the
holder of snapshots owns the disk. Imports are for persistent owners only (a client could otherwise
forge K/V under tokens it does not hold)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from engine_service.api.answers import ImportedSnapshot
from engine_service.api.checks import checked_int
from engine_service.api.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Stopping
from engine_service.persistence.snapshot_key import SnapshotKey
from engine_service.sessions.handles import HandleRegistry
from engine_service.sessions.session_files import EncodedSession, encode_session, load_session_bytes

if TYPE_CHECKING:
    from engine_service.runtime.runner import Runner
    from engine_service.runtime.session import Session

EXPORT_TIMEOUT_S = 60.0
HEADER_BYTES = 1 << 20  # room for the safetensors header and the content tensor beyond the K/V
BYTES_PER_POSITION_CAP = 1 << 20  # no supported model needs 1 MiB of K/V per position
MAX_EXTRA_KEY, MAX_EXTRA_VALUE = 128, 1 << 20


class SessionTransfer:
    """Exports and imports the sessions of ``registry`` over ``runner``, signed with ``key`` if given."""

    def __init__(
        self,
        runner: Runner,
        registry: HandleRegistry[Session],
        max_session_tokens: int,
        key: SnapshotKey | None = None,
    ) -> None:
        self._runner = runner
        self._registry = registry
        self._max_session_tokens = max_session_tokens
        self._key = key

    def max_bytes(self) -> int:
        """The largest import read: a full session at a generous bound per position."""
        return HEADER_BYTES + self._max_session_tokens * BYTES_PER_POSITION_CAP

    def export(
        self, owner: str, handle: str, extra: Mapping[str, str], upto: int | None = None
    ) -> EncodedSession:
        """The file of ``owner``'s ``handle`` (``[0, upto)``) carrying ``extra``, or its refusal."""
        for key, value in extra.items():
            if not key or len(key) > MAX_EXTRA_KEY or len(value) > MAX_EXTRA_VALUE:
                raise InvalidArgument(
                    f"extra[{key[:32]!r}]: keys must be 1-{MAX_EXTRA_KEY} characters, values at most 1 MiB"
                )
        session = self._registry.resolve(handle, owner)
        if upto is not None:
            checked_int("upto", upto, lo=0, hi=session.position)  # the session's committed positions
        return encode_session(session, extra=dict(extra), timeout=EXPORT_TIMEOUT_S, key=self._key, upto=upto)

    def import_(self, owner: str, chunks: Iterable[bytes]) -> ImportedSnapshot:
        persistent = self._registry.persistent_owners
        if owner not in persistent:
            raise FailedPrecondition(
                f"ImportSession is for persistent owners ({', '.join(sorted(persistent)) or 'none'}); "
                f"owner {owner!r} is not one"
            )
        limit = self.max_bytes()
        parts, size = [], 0
        for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise InvalidArgument(f"snapshot larger than this engine's largest session ({limit} bytes)")
            parts.append(chunk)
        outcome = load_session_bytes(
            self._runner, b"".join(parts), source="ImportSession", timeout=EXPORT_TIMEOUT_S, key=self._key
        )
        if not outcome.loaded:
            refusal = outcome.refusal.value if outcome.refusal else "unsupported"
            if refusal == "stopping":
                raise Stopping("the engine is shutting down")
            return ImportedSnapshot(None, refusal, outcome.detail)
        session = outcome.session
        try:
            handle = self._registry.register(session, owner, outcome.positions)
        except ResourceExhausted:
            session.close()
            raise
        return ImportedSnapshot(
            handle, "", "", outcome.positions, session.content_digest(), dict(outcome.extra)
        )
