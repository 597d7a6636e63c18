"""Proto <-> domain conversion for the engine service. Pure functions, no state, no engine calls.

Requests become domain values (token lists, :class:`PreparedInput`, :class:`GenConfig`) and are checked
against the engine's published limits on the way in, so malformed input is refused with
INVALID_ARGUMENT before any session is touched. Domain results become ``engine_pb2`` messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine_service.api.clones import CloneRefusal, refusal_text
from engine_service.api.errors import InvalidArgument
from engine_service.executors.base import ExecutorLimits, out_of_vocab
from engine_service.executors.prepared_input import EmbeddingsInput, PreparedInput
from engine_service.serving.engine_wire import CLONE_REFUSALS
from protos import engine_pb2 as pb

if TYPE_CHECKING:  # only annotations: the prefix service imports this module without the model code
    from engine_service.model.chat import ChatFormatter
    from engine_service.model.tokenizer import Tokenizer


def token_ids(ids: Sequence[int], vocab_size: int, field: str = "tokens") -> list[int]:
    """Token ids checked against the vocabulary: InvalidArgument naming ``field`` for a bad id."""
    out = list(ids)
    bad = out_of_vocab(out, vocab_size)
    if bad is not None:
        raise InvalidArgument(f"{field}[{bad}] = {out[bad]} is outside the vocabulary [0, {vocab_size})")
    return out


def text_tokens(msg: pb.TextInput, tokenizer: Tokenizer, chat: ChatFormatter | None) -> list[int]:
    """Tokenize a TextInput (chat-formatted first when ``msg.chat``: [system] + user(text), or the
    whole conversation in ``msg.messages``)."""
    if msg.chat:
        if chat is None:
            raise InvalidArgument("text.chat: this model has no chat template")
        if msg.messages and (msg.text or msg.system):
            raise InvalidArgument("text.messages replaces text.text and text.system: send one or the other")
        messages = [{"role": m.role, "content": m.content} for m in msg.messages] or (
            ([{"role": "system", "content": msg.system}] if msg.system else [])
            + [{"role": "user", "content": msg.text}]
        )
        return list(
            tokenizer.encode(chat.format(messages, add_generation_prompt=True), add_special_tokens=False)
        )
    if msg.system or msg.messages:
        raise InvalidArgument(
            f"text.{'system' if msg.system else 'messages'} is only used with text.chat = true"
        )
    return list(tokenizer.encode(msg.text, add_special_tokens=msg.add_special_tokens))


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


def generate_input(
    request: pb.GenerateRequest,
    tokenizer: Tokenizer,
    chat: ChatFormatter | None,
    vocab_size: int,
    hidden_size: int | None = None,
) -> list[int] | PreparedInput:
    """The request's input as a token list or a PreparedInput; InvalidArgument when absent or empty."""
    which = request.WhichOneof("input")
    if which == "tokens":
        ids = token_ids(request.tokens.ids, vocab_size)
    elif which == "text":
        ids = text_tokens(request.text, tokenizer, chat)
    elif which == "prepared":
        return prepared_input(request.prepared, hidden_size)
    else:
        raise InvalidArgument("input is required: one of tokens, text, prepared")
    if not ids:
        raise InvalidArgument(f"input.{which} is empty")
    return ids


def input_size(value: list[int] | PreparedInput) -> int:
    return value.size() if isinstance(value, PreparedInput) else len(value)


def check_fits(start: int, size: int, breakpoints: Sequence[int], limits: ExecutorLimits) -> None:
    """The input must fit the session and breakpoints must lie inside it: (start, start + size]."""
    if start + size > limits.max_session_tokens:
        raise InvalidArgument(
            f"input of {size} positions at position {start} exceeds max_session_tokens={limits.max_session_tokens}"
        )
    for b in breakpoints:
        if not start < b <= start + size:
            raise InvalidArgument(
                f"capture.breakpoints: {b} is outside the input's positions ({start}, {start + size}]"
            )


def clone_refused(reason: CloneRefusal, upto: int, text: str | None = None) -> pb.CloneResponse:
    """A refused Clone: its reason and, in words, ``text`` (default: the reason's)."""
    return pb.CloneResponse(refusal=text or refusal_text(reason, upto), reason=CLONE_REFUSALS[reason])
