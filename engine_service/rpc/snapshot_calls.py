"""The engine's ExportSession / ImportSession RPCs: snapshot files over gRPC, so that whoever persists
them (the prefix service's snapshot directory) holds the disk and engines share nothing on disk.

- Export: the caller's session is saved (``persistence.sessions.save_session``: the engine thread
  exports its committed positions, the file is written atomically) into a private temporary folder
  and streamed in ``CHUNK_BYTES`` chunks, the first carrying the header fields; the folder is removed
  when the stream ends, however it ends. A refusal is one chunk naming it.
- Import: persistent owners only (a client could otherwise forge K/V under tokens it does not hold
  and store it through Insert). The chunks, at most :func:`max_snapshot_bytes`, are written to a
  private temporary file and loaded with ``persistence.sessions.load_session`` (every check runs
  before anything enters the cache); the new session is registered to the caller, weighing its
  positions in the caller's quota. A refusal is a normal response with its reason.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from engine_service.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from engine_service.persistence.sessions import load_session, save_session
from protos import engine_pb2 as pb

if TYPE_CHECKING:
    from engine_service.rpc.servicer import EngineDeps

CHUNK_BYTES = 1 << 20  # 1 MiB: well under gRPC's 4 MiB message limit
EXPORT_TIMEOUT_S = 60.0
HEADER_BYTES = 1 << 20  # room for the safetensors header and the content tensor beyond the K/V
BYTES_PER_POSITION_CAP = 1 << 20  # no supported model needs 1 MiB of K/V per position


def max_snapshot_bytes(deps: EngineDeps) -> int:
    """The largest import accepted: a full session of this engine, with a generous per-position
    bound (the exact size depends on the model's K/V geometry; this only stops a runaway stream)."""
    return HEADER_BYTES + deps.limits.max_session_tokens * BYTES_PER_POSITION_CAP


def export_chunks(deps: EngineDeps, handle: str, owner: str, extra: Mapping[str, str]) -> Iterator[pb.SnapshotChunk]:
    """The snapshot file of ``owner``'s session ``handle``, chunk by chunk (see the module docstring)."""
    for key, value in extra.items():
        if not key or len(key) > 128 or len(value) > 1 << 20:
            raise InvalidArgument(f"extra[{key[:32]!r}]: keys must be 1-128 characters, values at most 1 MiB")
    session = deps.registry.resolve(handle, owner)
    with tempfile.TemporaryDirectory(prefix="forkline-export-") as folder:
        outcome = save_session(session, folder, extra=dict(extra), timeout=EXPORT_TIMEOUT_S)
        if not outcome.saved:
            yield pb.SnapshotChunk(refusal=str(outcome.refusal.value if outcome.refusal else "unsupported"))
            return
        header = {"file_bytes": outcome.file_bytes, "positions": outcome.positions,
                  "content_digest": outcome.content_digest or b""}
        with open(outcome.path, "rb") as f:
            while data := f.read(CHUNK_BYTES):
                yield pb.SnapshotChunk(data=data, **header)
                header = {}


def import_chunks(deps: EngineDeps, chunks: Iterable[pb.SnapshotChunk], owner: str) -> pb.ImportSessionResponse:
    """Load the streamed snapshot into a new session of ``owner`` (see the module docstring)."""
    persistent = deps.registry.persistent_owners
    if owner not in persistent:
        raise FailedPrecondition(f"ImportSession is for persistent owners ({', '.join(sorted(persistent)) or 'none'}); "
                                 f"owner {owner!r} is not one")
    limit = max_snapshot_bytes(deps)
    fd, name = tempfile.mkstemp(prefix="forkline-import-", suffix=".safetensors")
    path = Path(name)
    try:
        size = 0
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                size += len(chunk.data)
                if size > limit:
                    raise InvalidArgument(f"snapshot larger than this engine's largest session ({limit} bytes)")
                f.write(chunk.data)
        outcome = load_session(deps.runner, path, timeout=EXPORT_TIMEOUT_S)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    if not outcome.loaded:
        refusal = outcome.refusal.value if outcome.refusal else "unsupported"
        if refusal == "stopping":
            raise Unavailable("the engine is shutting down")
        return pb.ImportSessionResponse(refusal=refusal, detail=outcome.detail)
    session = outcome.session
    try:
        handle = deps.registry.register(session, owner, outcome.positions)
    except ResourceExhausted:
        session.close()
        raise
    return pb.ImportSessionResponse(session=handle, positions=outcome.positions,
                                    content_digest=session.content_digest() or b"", extra=dict(outcome.extra))
