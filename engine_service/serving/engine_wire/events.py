"""Stream events <-> ``GenerateEvent`` messages."""

from __future__ import annotations

from engine_service.api.errors import ForklineError
from engine_service.api.logprobs import LogprobEntry, TokenLogprob
from engine_service.api.stream_events import Done, Event, Snapshot, Started, Tokens
from engine_service.serving.engine_wire.answers import CLONE_REFUSALS, clone_refusal
from protos import engine_pb2 as pb


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
            resumes=event.resumes,
            resumed_positions=event.resumed_positions,
            resume_pause_s=event.resume_pause_s,
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
                d.resumes,
                d.resumed_positions,
                d.resume_pause_s,
            )
    except ValueError as exc:  # a kind or finish reason this side does not know
        raise ForklineError(f"unknown {which} event value: {exc}") from None
    raise ForklineError(f"unknown generate event {which!r}")
