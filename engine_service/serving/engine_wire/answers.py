"""The engine's answers about one session: clone, describe, export and import replies <-> api values.
``CloneRefusal`` travels as its proto enum; an unknown wire value reads as None (or BOUNDARY in a
clone reply that made no session)."""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum
from typing import Protocol

from engine_service.api.answers import CloneRefusal, Described, ImportedSnapshot, TakenClone, refusal_text
from protos import engine_pb2 as pb

CHUNK_BYTES = 1 << 20  # 1 MiB: well under gRPC's 4 MiB message limit

CLONE_REFUSALS: dict[CloneRefusal, pb.CloneRefusal.ValueType] = {
    reason: pb.CloneRefusal.Value(f"CLONE_REFUSAL_{reason.name}") for reason in CloneRefusal
}
_WIRE_CLONE_REFUSALS = {value: reason for reason, value in CLONE_REFUSALS.items()}


def clone_refusal(value: int) -> CloneRefusal | None:
    """A wire ``CloneRefusal`` as the enum (None: unspecified, or one this side does not know)."""
    return _WIRE_CLONE_REFUSALS.get(value) if value else None


def clone_response(taken: TakenClone, upto: int) -> pb.CloneResponse:
    """A Clone's answer: the new session, or its refusal's reason and words."""
    if taken.handle is not None:
        return pb.CloneResponse(
            session=taken.handle, position=upto, content_digest=taken.content_digest or b""
        )
    reason = taken.refusal or CloneRefusal.BOUNDARY
    return pb.CloneResponse(refusal=taken.detail or refusal_text(reason, upto), reason=CLONE_REFUSALS[reason])


def taken_clone(reply: pb.CloneResponse) -> TakenClone:
    """A Clone reply as ``GatewayBackend.take_clone`` answers it: the handle, or why not."""
    if reply.session:
        return TakenClone(reply.session)
    return TakenClone(None, _WIRE_CLONE_REFUSALS.get(reply.reason, CloneRefusal.BOUNDARY))


def describe_response(described: Described) -> pb.DescribeResponse:
    return pb.DescribeResponse(
        position=described.position,
        generating=described.generating,
        content_digest=described.content_digest or b"",
    )


def described(reply: pb.DescribeResponse) -> Described:
    return Described(reply.position, reply.content_digest or None, reply.generating)


class ExportedFile(Protocol):
    """An exported snapshot file (``sessions.session_files.EncodedSession``): its bytes, or why not."""

    @property
    def data(self) -> bytes | None: ...
    @property
    def refusal(self) -> Enum | None: ...
    @property
    def positions(self) -> int: ...
    @property
    def content_digest(self) -> bytes | None: ...


def snapshot_chunks(encoded: ExportedFile) -> Iterator[pb.SnapshotChunk]:
    """An exported file in ``CHUNK_BYTES`` chunks, the first carrying the header fields; a refusal is
    one chunk naming it."""
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


def import_response(imported: ImportedSnapshot) -> pb.ImportSessionResponse:
    if imported.handle is None:
        return pb.ImportSessionResponse(refusal=imported.refusal, detail=imported.detail)
    return pb.ImportSessionResponse(
        session=imported.handle,
        positions=imported.positions,
        content_digest=imported.content_digest or b"",
        extra=dict(imported.extra),
    )


def imported_snapshot(reply: pb.ImportSessionResponse) -> ImportedSnapshot:
    if not reply.session:
        return ImportedSnapshot(None, reply.refusal, reply.detail)
    return ImportedSnapshot(
        reply.session,
        positions=reply.positions,
        content_digest=reply.content_digest or None,
        extra=dict(reply.extra),
    )
