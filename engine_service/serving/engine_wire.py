"""The engine's messages as ``api`` values and back, for both ends of the engine wire: the engine's
servicer, its clients and the prefix service (whose gateway streams engine events to its own clients).

Pure functions. Unset optional ``GenerationConfig`` fields take :class:`GenConfig`'s defaults; enums
travel as their proto enums (``CloneRefusal``) or their wire strings (``FinishReason``, ``SnapshotKind``).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_service.api.answers import CloneRefusal
from engine_service.api.config import GenConfig
from engine_service.api.engine_info import EngineInfo, WindowGeometry
from engine_service.api.errors import ForklineError
from engine_service.api.logprobs import LogprobEntry, TokenLogprob
from engine_service.api.owners import OwnerQuota, OwnerUsage
from engine_service.api.stream_events import Done, Event, Snapshot, Started, Tokens
from protos import engine_pb2 as pb

DEFAULTS = GenConfig()

CLONE_REFUSALS: dict[CloneRefusal, pb.CloneRefusal.ValueType] = {
    reason: pb.CloneRefusal.Value(f"CLONE_REFUSAL_{reason.name}") for reason in CloneRefusal
}
_WIRE_CLONE_REFUSALS = {value: reason for reason, value in CLONE_REFUSALS.items()}


def clone_refusal(value: int) -> CloneRefusal | None:
    """A wire ``CloneRefusal`` as the enum (None: unspecified, or one this side does not know)."""
    return _WIRE_CLONE_REFUSALS.get(value) if value else None


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
        top_logprobs=msg.top_logprobs if msg.HasField("top_logprobs") else None,
        json_schema=msg.json_schema,
    )


def _entry_message(entry: LogprobEntry) -> pb.LogprobEntry:
    return pb.LogprobEntry(id=entry.id, logprob=entry.logprob, text=entry.text, raw=entry.raw)


def _entry(msg: pb.LogprobEntry) -> LogprobEntry:
    return LogprobEntry(msg.id, msg.logprob, msg.text, msg.raw)


def _logprob_message(value: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(chosen=_entry_message(value.chosen), top=[_entry_message(e) for e in value.top])


def event_message(event: Event) -> pb.GenerateEvent:
    """A stream event as the ``GenerateEvent`` that carries it."""
    if isinstance(event, Started):
        return pb.GenerateEvent(
            started=pb.StartedEvent(
                session=event.session, position=event.position, input_positions=event.input_positions
            )
        )
    if isinstance(event, Tokens):
        logprobs = [_logprob_message(value) for value in event.logprobs]
        return pb.GenerateEvent(
            tokens=pb.TokensEvent(ids=list(event.ids), text=event.text, logprobs=logprobs)
        )
    if isinstance(event, Snapshot):
        snapshot = pb.SnapshotEvent(
            handle=event.handle or "",
            position=event.position,
            kind=event.kind,
            refusal=event.refusal,
            content_digest=event.content_digest or b"",
            reason=CLONE_REFUSALS[event.reason] if event.reason is not None else 0,
        )
        return pb.GenerateEvent(snapshot=snapshot)
    timings = pb.Timings(
        time_to_first_token_s=event.time_to_first_token_s,
        decode_tokens_per_s=event.decode_tokens_per_s,
        total_s=event.total_s,
    )
    return pb.GenerateEvent(
        done=pb.DoneEvent(
            finish_reason=event.finish_reason,
            prompt_positions=event.prompt_positions,
            reused_positions=event.reused_positions,
            generated_tokens=event.generated_tokens,
            position=event.position,
            timings=timings,
            engine=event.engine,
        )
    )


def event_from_proto(msg: pb.GenerateEvent) -> Event:
    """A ``GenerateEvent`` as a stream event (an event or value this side does not know: ForklineError)."""
    which = msg.WhichOneof("event")
    if which == "started":
        return Started(msg.started.session, msg.started.position, msg.started.input_positions)
    if which == "tokens":
        logprobs = tuple(
            TokenLogprob(_entry(v.chosen), tuple(_entry(e) for e in v.top)) for v in msg.tokens.logprobs
        )
        return Tokens(tuple(msg.tokens.ids), msg.tokens.text, logprobs)
    try:
        if which == "snapshot":
            s = msg.snapshot
            return Snapshot(
                s.handle or None,
                s.position,
                s.kind,
                s.refusal,
                s.content_digest or None,
                clone_refusal(s.reason),
            )
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


def info_message(info: EngineInfo) -> pb.InfoResponse:
    """``EngineInfo`` as the engine's ``InfoResponse``."""
    caller, window = info.caller, info.window
    return pb.InfoResponse(
        model=info.model,
        fingerprint=info.fingerprint,
        limits=pb.Limits(
            max_sessions=info.max_sessions,
            max_session_tokens=info.max_session_tokens,
            vocab_size=info.vocab_size,
            idle_session_timeout_s=info.idle_session_timeout_s,
            owner_max_sessions=info.client_quota.max_sessions,
            owner_max_positions=info.client_quota.max_positions,
            persistent_owner_max_sessions=info.persistent_quota.max_sessions,
            persistent_owner_max_positions=info.persistent_quota.max_positions,
        ),
        cache_kind=info.cache_kind,
        instance_id=info.instance_id,
        resident_sessions=info.resident_sessions,
        open_handles=info.open_handles,
        eos_token_ids=list(info.eos_token_ids),
        caller=None
        if caller is None
        else pb.OwnerUsage(
            owner=caller.owner,
            persistent=caller.persistent,
            sessions=caller.sessions,
            positions=caller.positions,
            max_sessions=caller.quota.max_sessions,
            max_positions=caller.quota.max_positions,
        ),
        active_generations=info.active_generations,
        queued_commands=info.queued_commands,
        compute_path=info.compute_path,
        slow_path=info.slow_path,
        window=pb.WindowGeometry(
            sliding_window=window.sliding_window, max_write=window.max_write, evicts=window.evicts
        ),
        chat_template=info.chat_template,
        architecture=info.architecture,
        draining=info.draining,
        heartbeat_age_s=info.heartbeat_age_s,
        heartbeat_longest_s=info.heartbeat_longest_s,
        pinned_exports=info.pinned_exports,
    )


def engine_info(msg: pb.InfoResponse) -> EngineInfo:
    """An ``InfoResponse`` as ``EngineInfo`` (``caller`` None when it names no owner)."""
    limits, caller, window = msg.limits, msg.caller, msg.window
    return EngineInfo(
        instance_id=msg.instance_id,
        fingerprint=msg.fingerprint,
        vocab_size=limits.vocab_size,
        max_session_tokens=limits.max_session_tokens,
        max_sessions=limits.max_sessions,
        model=msg.model,
        cache_kind=msg.cache_kind,
        architecture=msg.architecture,
        eos_token_ids=tuple(msg.eos_token_ids),
        chat_template=msg.chat_template,
        idle_session_timeout_s=limits.idle_session_timeout_s,
        client_quota=OwnerQuota(limits.owner_max_sessions, limits.owner_max_positions),
        persistent_quota=OwnerQuota(
            limits.persistent_owner_max_sessions, limits.persistent_owner_max_positions
        ),
        caller=OwnerUsage(
            caller.owner,
            caller.persistent,
            caller.sessions,
            caller.positions,
            OwnerQuota(caller.max_sessions, caller.max_positions),
        )
        if caller.owner
        else None,
        resident_sessions=msg.resident_sessions,
        open_handles=msg.open_handles,
        active_generations=msg.active_generations,
        queued_commands=msg.queued_commands,
        window=WindowGeometry(window.sliding_window, window.max_write, window.evicts),
        compute_path=msg.compute_path,
        slow_path=msg.slow_path,
        draining=msg.draining,
        heartbeat_age_s=msg.heartbeat_age_s,
        heartbeat_longest_s=msg.heartbeat_longest_s,
        pinned_exports=msg.pinned_exports,
    )
