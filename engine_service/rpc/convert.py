"""Proto <-> domain conversion for the engine servicer: requests become ``sessions`` requests and
``api`` values (checked later, against the engine's limits, by the sessions facade), answers become
``engine_pb2`` messages. Pure functions; messages shared with the engine's clients are
``serving/engine_wire.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from engine_service.api.answers import CloneRefusal, Described, ImportedSnapshot, TakenClone, refusal_text
from engine_service.api.errors import InvalidArgument
from engine_service.api.prompts import TextPrompt
from engine_service.executors.prepared_input import EmbeddingsInput, PreparedInput
from engine_service.serving.engine_wire import CLONE_REFUSALS, gen_config
from engine_service.sessions.engine import GenerationRequest
from engine_service.sessions.inputs import Input
from engine_service.sessions.session_files import EncodedSession
from protos import engine_pb2 as pb

CHUNK_BYTES = 1 << 20  # 1 MiB: well under gRPC's 4 MiB message limit


def text_prompt(msg: pb.TextInput) -> TextPrompt:
    messages = tuple((m.role, m.content) for m in msg.messages)
    return TextPrompt(msg.text, msg.chat, msg.system, msg.add_special_tokens, messages)


def prepared_input(msg: pb.PreparedInput, hidden_size: int | None = None) -> PreparedInput:
    """Decode a registered prepared kind. ``embeddings``: little-endian float32 [positions, hidden],
    finite, with ``hidden == hidden_size`` when the engine publishes one.

    The array is copied out of the request into a fresh MLX array (no computation); the engine thread
    is the only one that evaluates anything with it.
    """
    if msg.kind != "embeddings":
        raise InvalidArgument(f"prepared.kind {msg.kind!r} is not registered (known: 'embeddings')")
    shape = tuple(msg.shape)
    if len(shape) != 2 or min(shape) < 1:
        raise InvalidArgument(f"prepared.shape must be [positions, hidden] with both >= 1, got {list(shape)}")
    if len(msg.payload) != 4 * shape[0] * shape[1]:
        raise InvalidArgument(
            f"prepared.payload has {len(msg.payload)} bytes, shape {list(shape)} needs {4 * shape[0] * shape[1]}"
        )
    if hidden_size is not None and shape[1] != hidden_size:
        raise InvalidArgument(
            f"prepared.shape[1] = {shape[1]} must equal the model's hidden size {hidden_size}"
        )
    import mlx.core as mx  # only for this kind; the array is built, never evaluated, here

    data = np.frombuffer(msg.payload, dtype="<f4").reshape(shape)
    if not np.isfinite(data).all():  # NaN / inf rows would only produce garbage for this session
        raise InvalidArgument("prepared.payload holds non-finite values (NaN or infinity)")
    return EmbeddingsInput(mx.array(data))


def generation_request(
    request: pb.GenerateRequest, eos_token_ids: Sequence[int], hidden_size: int | None
) -> GenerationRequest:
    """The Generate request as a domain request; InvalidArgument when it names no input."""
    which = request.WhichOneof("input")
    value: Input
    if which == "tokens":
        value = list(request.tokens.ids)
    elif which == "text":
        value = text_prompt(request.text)
    elif which == "prepared":
        value = prepared_input(request.prepared, hidden_size)
    else:
        raise InvalidArgument("input is required: one of tokens, text, prepared")
    capture = request.capture
    return GenerationRequest(
        input=value,
        config=gen_config(request.config, eos_token_ids, tuple(capture.breakpoints)),
        session=request.session,
        keep_session=request.keep_session,
        close_session=request.close_session,
        prompt_snapshot=capture.prompt_snapshot,
        snapshot_owner=capture.snapshot_owner,
    )


def clone_response(taken: TakenClone, upto: int) -> pb.CloneResponse:
    """A Clone's answer: the new session, or its refusal's reason and words."""
    if taken.handle is not None:
        return pb.CloneResponse(
            session=taken.handle, position=upto, content_digest=taken.content_digest or b""
        )
    reason = taken.refusal or CloneRefusal.BOUNDARY
    return pb.CloneResponse(refusal=taken.detail or refusal_text(reason, upto), reason=CLONE_REFUSALS[reason])


def describe_response(described: Described) -> pb.DescribeResponse:
    return pb.DescribeResponse(
        position=described.position,
        generating=described.generating,
        content_digest=described.content_digest or b"",
    )


def snapshot_chunks(encoded: EncodedSession) -> Iterator[pb.SnapshotChunk]:
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
