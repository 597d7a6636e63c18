"""What only the engine's servicer reads: the Generate request as the sessions' request, prepared
inputs decoded. Every other conversion is the engine wire's (``serving/engine_wire``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine_service.api.errors import InvalidArgument
from engine_service.executors.prepared_input import EmbeddingsInput, PreparedInput
from engine_service.serving.engine_wire import (
    clone_response,
    describe_response,
    gen_config,
    import_response,
    snapshot_chunks,
    text_prompt,
)
from engine_service.sessions.engine import GenerationRequest
from engine_service.sessions.inputs import Input
from protos import engine_pb2 as pb

# The wire's answers keep their names here: rpc/servicer.py calls them through this module.
__all__ = [
    "clone_response",
    "describe_response",
    "generation_request",
    "import_response",
    "prepared_input",
    "snapshot_chunks",
    "text_prompt",
]


def prepared_input(msg: pb.PreparedInput, hidden_size: int | None = None) -> PreparedInput:
    """Decode a registered prepared kind. ``embeddings``: little-endian float32 [positions, hidden],
    finite, with ``hidden == hidden_size`` when the engine publishes one."""
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
    import mlx.core as mx  # only for this kind; the array is built, never evaluated: the engine thread does

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
        final_snapshot=capture.final_snapshot,
        checkpoint_every=capture.checkpoint_every,
    )
