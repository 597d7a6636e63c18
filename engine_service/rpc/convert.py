"""Proto <-> domain conversion for the engine service. Pure functions, no state, no engine calls.

Requests become domain values (token lists, :class:`PreparedInput`, :class:`GenConfig`) and are checked
against the engine's published limits on the way in, so malformed input is refused with
INVALID_ARGUMENT before any session is touched. Domain results become ``engine_pb2`` messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine_service.api.clones import CloneRefusal
from engine_service.api.config import GenConfig
from engine_service.api.errors import ForklineError, InvalidArgument
from engine_service.api.owners import DEFAULT_OWNER, NO_QUOTA, OwnerQuota, OwnerUsage, check_owner
from engine_service.api.stream_events import Done, Event, Snapshot, Started, Tokens
from engine_service.auth import current_caller
from engine_service.executors.base import ExecutorLimits, WindowGeometry, out_of_vocab
from engine_service.executors.prepared_input import EmbeddingsInput, PreparedInput
from engine_service.runtime.generation import GenerationResult
from protos import engine_pb2 as pb

if TYPE_CHECKING:  # only annotations: the prefix service imports this module without the model code
    from engine_service.model.chat import ChatFormatter
    from engine_service.model.tokenizer import Tokenizer

OWNER_METADATA_KEY = "forkline-owner"

DEFAULTS = GenConfig()


def owner_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The caller's owner id: the authenticated owner when the call carried a valid token (auth on,
    see ``engine_service/auth.py``; the header is then ignored), else the request metadata's
    ``forkline-owner``; absent -> ``anonymous``."""
    caller = current_caller()
    if caller is not None:
        return caller.owner
    for key, value in metadata or ():
        if key == OWNER_METADATA_KEY:
            return check_owner(value.decode() if isinstance(value, bytes) else str(value), OWNER_METADATA_KEY)
    return DEFAULT_OWNER


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


def gen_config(
    msg: pb.GenerationConfig, eos_token_ids: Sequence[int], breakpoints: Sequence[int] = ()
) -> GenConfig:
    """A GenConfig from the request; unset fields take GenConfig's defaults. Stops default to EOS."""
    stops = tuple(msg.stop_tokens) or (() if msg.ignore_eos else tuple(eos_token_ids))
    return GenConfig(
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else DEFAULTS.max_new_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else DEFAULTS.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else DEFAULTS.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else DEFAULTS.top_k,
        seed=msg.seed if msg.HasField("seed") else DEFAULTS.seed,
        stop_tokens=stops,
        prefill_chunk=msg.prefill_chunk if msg.HasField("prefill_chunk") else DEFAULTS.prefill_chunk,
        prefill_breakpoints=tuple(breakpoints),
    )


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


def started_event(handle: str, position: int, input_positions: int) -> pb.GenerateEvent:
    return pb.GenerateEvent(
        started=pb.StartedEvent(session=handle, position=position, input_positions=input_positions)
    )


def tokens_event(ids: Sequence[int], text: str) -> pb.GenerateEvent:
    return pb.GenerateEvent(tokens=pb.TokensEvent(ids=list(ids), text=text))


CLONE_REFUSALS: dict[CloneRefusal, pb.CloneRefusal.ValueType] = {
    reason: pb.CloneRefusal.Value(f"CLONE_REFUSAL_{reason.name}") for reason in CloneRefusal
}
_CLONE_REFUSAL_TEXT = {
    CloneRefusal.POSITION: "upto={upto} is past the session's committed position",
    CloneRefusal.BOUNDARY: "the engine refused to clone at position {upto} (boundary unavailable or no room)",
    CloneRefusal.CONTENT_MISMATCH: "[0, {upto}) does not hold the content expected_content_digest names",
    CloneRefusal.PREPARED_INPUT: "[0, {upto}) holds a prepared input, which has no token content digest",
    CloneRefusal.SOURCE_UNUSABLE: "the session is closed or failed",
    CloneRefusal.STOPPING: "the engine is stopping",
    CloneRefusal.QUOTA: "the snapshot's owner has no room left in its quota",
    CloneRefusal.WINDOW: "position {upto} is below the session's sliding-window floor (the ring no longer holds "
    "the rows)",
}
_WIRE_CLONE_REFUSALS = {value: reason for reason, value in CLONE_REFUSALS.items()}


def snapshot_event(
    handle: str | None,
    position: int,
    kind: str,
    content_digest: bytes | None = None,
    refusal: CloneRefusal | None = None,
    text: str = "",
) -> pb.GenerateEvent:
    """A snapshot event: ``handle`` holding ``[0, position)`` with ``content_digest`` (None: it holds a
    prepared input), or a refused clone (``handle`` None) and why (``text``: default the reason's)."""
    if handle:
        msg = pb.SnapshotEvent(
            handle=handle, position=position, kind=kind, content_digest=content_digest or b""
        )
    else:
        reason = refusal or CloneRefusal.BOUNDARY
        msg = pb.SnapshotEvent(
            position=position,
            kind=kind,
            refusal=text or clone_refusal_text(reason, position),
            reason=CLONE_REFUSALS[reason],
        )
    return pb.GenerateEvent(snapshot=msg)


def clone_refusal_text(reason: CloneRefusal, upto: int) -> str:
    return _CLONE_REFUSAL_TEXT[reason].format(upto=upto)


def clone_refused(reason: CloneRefusal, upto: int, text: str | None = None) -> pb.CloneResponse:
    """A refused Clone: its reason and, in words, ``text`` (default: the reason's)."""
    return pb.CloneResponse(refusal=text or clone_refusal_text(reason, upto), reason=CLONE_REFUSALS[reason])


def done_event(result: GenerationResult, reused: int, position: int) -> pb.GenerateEvent:
    m = result.metrics
    return pb.GenerateEvent(
        done=pb.DoneEvent(
            finish_reason=result.finish_reason,
            prompt_positions=m.prompt_positions,
            reused_positions=reused,
            generated_tokens=m.generated_tokens,
            position=position,
            timings=pb.Timings(
                time_to_first_token_s=m.time_to_first_token_s or 0.0,
                decode_tokens_per_s=m.decode_tokens_per_s,
                total_s=m.total_s,
            ),
        )
    )


def window_message(window: WindowGeometry | None) -> pb.WindowGeometry | None:
    """InfoResponse.window (None: the executor does not describe it)."""
    if window is None:
        return None
    return pb.WindowGeometry(
        sliding_window=window.sliding_window, max_write=window.max_write, evicts=window.evicts
    )


def limits_message(
    limits: ExecutorLimits,
    idle_timeout_s: float,
    quota: OwnerQuota = NO_QUOTA,
    persistent_quota: OwnerQuota = NO_QUOTA,
) -> pb.Limits:
    return pb.Limits(
        max_sessions=limits.max_sessions,
        max_session_tokens=limits.max_session_tokens,
        vocab_size=limits.vocab_size,
        idle_session_timeout_s=idle_timeout_s,
        owner_max_sessions=quota.max_sessions,
        owner_max_positions=quota.max_positions,
        persistent_owner_max_sessions=persistent_quota.max_sessions,
        persistent_owner_max_positions=persistent_quota.max_positions,
    )


def owner_usage(usage: OwnerUsage) -> pb.OwnerUsage:
    return pb.OwnerUsage(
        owner=usage.owner,
        persistent=usage.persistent,
        sessions=usage.sessions,
        positions=usage.positions,
        max_sessions=usage.quota.max_sessions,
        max_positions=usage.quota.max_positions,
    )


def event_from_proto(msg: pb.GenerateEvent) -> Event:
    """An engine stream event as a domain value (an event this service does not know: ForklineError)."""
    which = msg.WhichOneof("event")
    if which == "started":
        return Started(msg.started.session, msg.started.position, msg.started.input_positions)
    if which == "tokens":
        return Tokens(tuple(msg.tokens.ids), msg.tokens.text)
    try:
        if which == "snapshot":
            s = msg.snapshot
            reason = _WIRE_CLONE_REFUSALS.get(s.reason) if s.reason else None
            return Snapshot(s.handle or None, s.position, s.kind, s.refusal, s.content_digest or None, reason)
        if which == "done":
            d, t = msg.done, msg.done.timings
            return Done(
                d.finish_reason,
                d.prompt_positions,
                d.reused_positions,
                d.generated_tokens,
                d.position,
                t.time_to_first_token_s,
                t.decode_tokens_per_s,
                t.total_s,
                d.engine,
            )
    except ValueError as exc:  # a kind or finish reason this side does not know
        raise ForklineError(f"unknown {which} event value: {exc}") from None
    raise ForklineError(f"unknown generate event {which!r}")
