"""Save a session to a snapshot file, load one back: the two calls a caller (the CLI, the prefix
service's persistent tier) makes. Each waits for one engine command and does the file work on the
calling thread, so never call them from a generation callback.

    outcome = save_session(session, "snapshots/")       # SaveOutcome: path, positions, bytes, or refusal
    loaded = load_session(runner, outcome.path)          # LoadOutcome: a new idle Session, or refusal
    loaded.session.generate_async(suffix, config)        # continues exactly like the saved session

A session saved at position ``p`` and loaded holds ``[0, p)`` with the same K/V, ring state and
content record (so ``Session.content_digest`` and digest-checked clones work on it); the saved
session's pending prediction is not part of it: feed the next token as the caller would after a clone.

Over an RPC (an engine's K/V to a prefix service's disk and back): ``encode_session`` gives the file's
bytes, the receiver writes them with ``api.snapshot_files.write_snapshot_bytes``, and ``load_session_bytes``
imports bytes with the same checks as a file.

``key`` (every call): the engine's :class:`SnapshotKey` (``--snapshot_key``): saves are signed with it,
and loads refuse what it does not verify (``unsigned``, ``bad_signature``); None signs nothing and
loads unsigned files only.
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
    """What :func:`load_session` did: the new idle ``session`` (the caller owns it) or why not.

    content: the token ids the session holds (empty when refused before the file was vouched for);
    extra: the application strings saved with it."""

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
    """Export ``session`` (its committed positions) and write it into ``folder`` atomically, named
    ``name`` or :func:`snapshot_name` (fingerprint and content digest). The session is unchanged.
    OSError when the file cannot be written (nothing is left under the name)."""
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
    """The bytes :func:`save_session` would write for ``session`` (for an RPC stream: the receiver
    writes them with ``write_snapshot_bytes`` and any engine loads them with :func:`load_session_bytes`);
    ``upto``: only positions ``[0, upto)`` (see ``Session.export_async``)."""
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
    """Read and verify the snapshot in ``path`` (container, format version, signature, checksum, content), then
    import it into ``runner`` (cache kind, geometry, fingerprint, limits and array shapes checked on
    the engine thread before anything is allocated). Never raises for a bad file: a refusal says why."""
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
    """:func:`load_session` of a snapshot file's bytes (received over an RPC); ``source`` names it in
    refusals."""
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
