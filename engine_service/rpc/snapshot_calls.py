"""The engine's ExportSession / ImportSession RPCs: snapshot files over gRPC, so that whoever persists
them (the prefix service's snapshot directory) holds the disk and engines share nothing on disk.

- Export: the caller's session is encoded (``persistence.sessions.encode_session``: the engine thread
  exports its committed positions, the file's bytes are built in memory) and streamed in
  ``CHUNK_BYTES`` chunks, the first carrying the header fields. A refusal is one chunk naming it.
- Import: persistent owners only (a client could otherwise forge K/V under tokens it does not hold
  and store it through Insert). The chunks, at most :func:`max_snapshot_bytes`, are joined and
  loaded with ``persistence.sessions.load_session_bytes`` (every check runs before anything enters
  the cache); the new session is registered to the caller, weighing its
  positions in the caller's quota. A refusal is a normal response with its reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from engine_service.api.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Stopping
from engine_service.persistence.sessions import encode_session, load_session_bytes
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


def export_chunks(
    deps: EngineDeps, handle: str, owner: str, extra: Mapping[str, str]
) -> Iterator[pb.SnapshotChunk]:
    """The snapshot file of ``owner``'s session ``handle``, chunk by chunk (see the module docstring)."""
    for key, value in extra.items():
        if not key or len(key) > 128 or len(value) > 1 << 20:
            raise InvalidArgument(f"extra[{key[:32]!r}]: keys must be 1-128 characters, values at most 1 MiB")
    session = deps.registry.resolve(handle, owner)
    encoded = encode_session(session, extra=dict(extra), timeout=EXPORT_TIMEOUT_S)
    if encoded.data is None:
        yield pb.SnapshotChunk(refusal=str(encoded.refusal.value if encoded.refusal else "unsupported"))
        return
    data = memoryview(encoded.data)
    header = {
        "file_bytes": len(data),
        "positions": encoded.positions,
        "content_digest": encoded.content_digest or b"",
    }
    for start in range(0, len(data), CHUNK_BYTES):
        yield pb.SnapshotChunk(data=bytes(data[start : start + CHUNK_BYTES]), **header)
        header = {}


def import_chunks(
    deps: EngineDeps, chunks: Iterable[pb.SnapshotChunk], owner: str
) -> pb.ImportSessionResponse:
    """Load the streamed snapshot into a new session of ``owner`` (see the module docstring)."""
    persistent = deps.registry.persistent_owners
    if owner not in persistent:
        raise FailedPrecondition(
            f"ImportSession is for persistent owners ({', '.join(sorted(persistent)) or 'none'}); "
            f"owner {owner!r} is not one"
        )
    limit = max_snapshot_bytes(deps)
    parts, size = [], 0
    for chunk in chunks:
        size += len(chunk.data)
        if size > limit:
            raise InvalidArgument(f"snapshot larger than this engine's largest session ({limit} bytes)")
        parts.append(chunk.data)
    outcome = load_session_bytes(
        deps.runner, b"".join(parts), source="ImportSession", timeout=EXPORT_TIMEOUT_S
    )
    if not outcome.loaded:
        refusal = outcome.refusal.value if outcome.refusal else "unsupported"
        if refusal == "stopping":
            raise Stopping("the engine is shutting down")
        return pb.ImportSessionResponse(refusal=refusal, detail=outcome.detail)
    session = outcome.session
    try:
        handle = deps.registry.register(session, owner, outcome.positions)
    except ResourceExhausted:
        session.close()
        raise
    return pb.ImportSessionResponse(
        session=handle,
        positions=outcome.positions,
        content_digest=session.content_digest() or b"",
        extra=dict(outcome.extra),
    )
