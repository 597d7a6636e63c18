"""Save a session to a snapshot file (or its bytes) and load one back into a runner; each call waits for
one engine command, so never from a generation callback. ``key``: signs saves, verifies loads.
Spec: docs/SNAPSHOTS.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from engine_service.api.snapshot_files import LoadRefusal, SaveRefusal, SnapshotRefused, snapshot_name
from engine_service.persistence.snapshot import SessionSnapshot
from engine_service.persistence.snapshot_file import (
    decode_snapshot,
    encode_snapshot,
    read_snapshot,
    write_snapshot,
)
from engine_service.persistence.snapshot_key import SnapshotKey
from engine_service.runtime.runner import Runner
from engine_service.runtime.session import Session

_NONE: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class SaveOutcome:
    """What :func:`save_session` did: the file (``path``) or why not (``refusal``)."""

    path: Path | None
    refusal: SaveRefusal | None = None
    positions: int = 0
    file_bytes: int = 0
    kv_bytes: int = 0
    content_digest: bytes | None = None

    @property
    def saved(self) -> bool:
        return self.path is not None


@dataclass(frozen=True)
class LoadOutcome:
    """What :func:`load_session` did: a new idle ``session`` the caller owns, or why not."""

    session: Session | None
    refusal: LoadRefusal | None = None
    detail: str = ""
    positions: int = 0
    file_bytes: int = 0
    content: tuple[int, ...] = ()
    extra: Mapping[str, str] = field(default_factory=lambda: _NONE)

    @property
    def loaded(self) -> bool:
        return self.session is not None


def save_session(
    session: Session,
    folder: str | os.PathLike,
    *,
    name: str | None = None,
    extra: Mapping[str, str] | None = None,
    timeout: float | None = None,
    key: SnapshotKey | None = None,
) -> SaveOutcome:
    """Export ``session``'s committed positions into ``folder`` atomically, named ``name`` or
    :func:`snapshot_name`; OSError when the file cannot be written."""
    future = session.export_async()
    snapshot = future.result(timeout)
    if snapshot is None:
        return SaveOutcome(None, future.refusal)
    if extra:
        snapshot = snapshot.with_extra(extra)
    path = Path(folder) / (name or snapshot_name(snapshot.fingerprint, snapshot.content_digest))
    size = write_snapshot(path, snapshot, key=key)
    return SaveOutcome(path, None, snapshot.positions, size, snapshot.nbytes, snapshot.content_digest)


@dataclass(frozen=True)
class EncodedSession:
    """What :func:`encode_session` did: the snapshot file's bytes (``data``) or why not (``refusal``)."""

    data: bytes | None
    refusal: SaveRefusal | None = None
    positions: int = 0
    content_digest: bytes | None = None


def encode_session(
    session: Session,
    *,
    extra: Mapping[str, str] | None = None,
    timeout: float | None = None,
    key: SnapshotKey | None = None,
    upto: int | None = None,
) -> EncodedSession:
    """The bytes :func:`save_session` would write (positions ``[0, upto)`` with ``upto``)."""
    future = session.export_async(upto)
    snapshot = future.result(timeout)
    if snapshot is None:
        return EncodedSession(None, future.refusal)
    if extra:
        snapshot = snapshot.with_extra(extra)
    return EncodedSession(
        encode_snapshot(snapshot, key=key), None, snapshot.positions, snapshot.content_digest
    )


def load_session(
    runner: Runner,
    path: str | os.PathLike,
    *,
    timeout: float | None = None,
    key: SnapshotKey | None = None,
) -> LoadOutcome:
    """Read, verify and import ``path`` into ``runner``; a bad file is a refusal, never an exception."""
    try:
        snapshot = read_snapshot(path, key=key)
    except SnapshotRefused as refused:
        return LoadOutcome(None, refused.reason, refused.detail)
    return _import(runner, snapshot, os.path.getsize(path) if os.path.exists(path) else 0, timeout)


def load_session_bytes(
    runner: Runner,
    data: bytes,
    *,
    source: str = "snapshot",
    timeout: float | None = None,
    key: SnapshotKey | None = None,
) -> LoadOutcome:
    try:
        snapshot = decode_snapshot(data, source, key=key)
    except SnapshotRefused as refused:
        return LoadOutcome(None, refused.reason, refused.detail)
    return _import(runner, snapshot, len(data), timeout)


def _import(runner: Runner, snapshot: SessionSnapshot, size: int, timeout: float | None) -> LoadOutcome:
    future = runner.import_async(snapshot)
    session = future.result(timeout)
    if session is None:
        return LoadOutcome(None, future.refusal, future.detail, snapshot.positions, size)
    return LoadOutcome(session, None, "", snapshot.positions, size, snapshot.content, snapshot.extra)
