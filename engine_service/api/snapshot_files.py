"""Snapshot files as a holder of files sees them, without the arrays: names, the unverified header,
atomic writes, and why a save or load is refused. Spec: docs/SNAPSHOTS.md (the snapshot file).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import BinaryIO

from engine_service.api.errors import FailedPrecondition

SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
FORMAT = "forkline-session-snapshot"
FORMAT_VERSION = 1


class LoadRefusal(StrEnum):
    """Why a snapshot was not loaded (values: the wire names); a refused load changes nothing."""

    UNREADABLE = "unreadable"  # missing, truncated, not a safetensors file, or a field is missing
    FORMAT_VERSION = "format_version"  # another format or format version
    CHECKSUM = "checksum"  # the bytes differ from what was written (a flipped byte, a partial write)
    UNSIGNED = "unsigned"  # no MAC, and this engine loads only files signed with its --snapshot_key
    BAD_SIGNATURE = "bad_signature"  # a MAC that does not verify under this engine's key (forged,
    # damaged, another key's), or a signed file and this engine has no key
    CONTENT = "content"  # the recorded content disagrees with its digest or with the positions
    CACHE_KIND = "cache_kind"  # taken under another cache kind
    GEOMETRY = "geometry"  # taken under another window geometry / K/V row shape / dtype / max_write
    FINGERPRINT = "fingerprint"  # taken under another model, tokenizer or weights dtype
    SHAPE = "shape"  # its arrays do not fit this engine's layout
    TOO_LONG = "too_long"  # more positions than the engine's max_session_tokens
    NO_ROOM = "no_room"  # no free session slot or cache capacity now
    UNSUPPORTED = "unsupported"  # this executor does not import sessions
    STOPPING = "stopping"  # the runner is stopping


class SaveRefusal(StrEnum):
    """Why a session was not exported (the values are the wire names, lower case)."""

    SOURCE_UNUSABLE = "source_unusable"  # closed or failed
    PREPARED_INPUT = "prepared_input"  # a position holds a prepared input: no token content to record
    BOUNDARY = "boundary"  # the executor refused: the rows its committed positions need are gone
    UNSUPPORTED = "unsupported"  # this executor does not export sessions
    STOPPING = "stopping"  # the runner is stopping


class SnapshotRefused(FailedPrecondition):
    """A snapshot file or object was refused; ``reason`` says why, ``str()`` adds the detail."""

    def __init__(self, reason: LoadRefusal, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class StateLayout:
    """The layout of an executor's exported sessions: its cache kind and :func:`geometry_text`."""

    cache_kind: str
    geometry: str


@dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot file's header, NOT verified: enough to choose which files to load."""

    path: Path
    file_bytes: int
    fingerprint: str
    layout: StateLayout
    positions: int
    content_digest: str
    extra: Mapping[str, str]
    signed: bool = False  # the header claims a MAC (only an engine with the key can tell it is one)


def peek_snapshot(path: str | os.PathLike) -> SnapshotInfo:
    """The header of the snapshot in ``path`` (SnapshotRefused UNREADABLE / FORMAT_VERSION)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            header = f.read(size) if 0 <= size <= 100_000_000 else b""
        file_bytes = path.stat().st_size
        meta = json.loads(header)["__metadata__"]
        if meta.get("format") != FORMAT or meta.get("format_version") != str(FORMAT_VERSION):
            raise SnapshotRefused(
                LoadRefusal.FORMAT_VERSION,
                f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r}",
            )
        return SnapshotInfo(
            path,
            file_bytes,
            meta["fingerprint"],
            StateLayout(meta["cache_kind"], meta["geometry"]),
            int(meta["positions"]),
            meta["content_digest"],
            MappingProxyType(dict(json.loads(meta["extra"]))),
            "mac" in meta,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotRefused(LoadRefusal.UNREADABLE, f"{path}: not a snapshot header ({exc})") from None


def snapshot_name(fingerprint: str, digest: bytes) -> str:
    """One name per (configuration, content): saving the same prompt twice writes the same file."""
    return f"{fingerprint[:16]}-{digest.hex()}{SUFFIX}"


def list_snapshots(folder: str | os.PathLike) -> list[Path]:
    """The snapshot files in ``folder`` (temporaries excluded), most recently written first."""
    paths = [p for p in Path(folder).iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith(".")]
    return sorted(paths, key=lambda p: p.stat().st_mtime_ns, reverse=True)


def write_snapshot_bytes(path: str | os.PathLike, data: bytes) -> int:
    """Write an encoded snapshot to ``path`` atomically, unchecked (a load checks); its size."""
    return atomic_write(Path(path), lambda f: f.write(data))


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> int:
    """``write(file)`` to a temporary next to ``path``, fsync, rename, fsync the folder; the size."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    try:
        with open(temp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        size = temp.stat().st_size
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    _fsync_folder(path.parent)
    return size


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
