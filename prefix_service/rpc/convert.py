"""Proto <-> domain conversion for the prefix service. Pure functions: no state, no engine calls.

Client requests (``prefix_pb2``) become gateway values (:class:`Prompt`, :class:`GatewayRequest`);
gateway results become responses. Engine messages (``engine_pb2``) become the backend's domain
values (:class:`EngineInfo`, the stream events of ``engine_service/api/stream_events.py``) and back: the
gateway's events for its client are engine ``GenerateEvent`` messages again.
"""

from __future__ import annotations

from dataclasses import asdict

from engine_service.api.answers import CloneRefusal, TakenClone
from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidArgument
from engine_service.api.prompts import TextPrompt
from engine_service.serving.engine_wire import CLONE_REFUSALS, event_message, gen_config
from prefix_service.cache.outcomes import InsertOutcome, InsertRefusal, MissReason
from prefix_service.fleet_stats import EngineStatus, FleetStats
from prefix_service.gateway.gateway import GatewayEvent, GatewayRequest, Prompt, PromptLookup
from prefix_service.gateway.gateway_backend import EngineGenerate
from protos import engine_pb2 as epb
from protos import prefix_pb2 as pb

MISS_REASONS: dict[MissReason | None, pb.MissReason.ValueType] = {
    None: pb.MISS_REASON_UNSPECIFIED,
    **{reason: pb.MissReason.Value(f"MISS_REASON_{reason.name}") for reason in MissReason},
}
INSERT_REFUSALS: dict[InsertRefusal | None, pb.InsertRefusal.ValueType] = {
    None: pb.INSERT_REFUSAL_UNSPECIFIED,
    **{reason: pb.InsertRefusal.Value(f"INSERT_REFUSAL_{reason.name}") for reason in InsertRefusal},
}
_CLONE_REFUSALS = {value: reason for reason, value in CLONE_REFUSALS.items()}  # engine wire -> domain

# -- client side ------------------------------------------------------------------------------


def prompt(request: pb.LookupRequest | pb.GatewayGenerateRequest) -> Prompt:
    """The request's input: token ids (checked later against the engine's vocabulary) or text."""
    which = request.WhichOneof("input")
    if which == "tokens":
        return list(request.tokens.ids)
    if which == "text":
        return text_prompt(request.text)
    raise InvalidArgument("input is required: one of tokens, text")


def text_prompt(msg: epb.TextInput) -> TextPrompt:
    messages = tuple((m.role, m.content) for m in msg.messages)
    return TextPrompt(msg.text, msg.chat, msg.system, msg.add_special_tokens, messages)


def gateway_request(request: pb.GatewayGenerateRequest) -> GatewayRequest:
    """The gateway call; the config is checked here (InvalidArgument before any lookup). Its stop
    tokens stay as sent: the engine adds its EOS tokens unless ``ignore_eos``."""
    return GatewayRequest(
        namespace=request.namespace,
        prompt=prompt(request),
        config=gen_config(request.config, ()),
        ignore_eos=request.config.ignore_eos,
        store_prompt=not request.skip_insert,
        metadata=dict(request.metadata),
    )


def lookup_response(lookup: PromptLookup) -> pb.LookupResponse:
    outcome = lookup.outcome
    return pb.LookupResponse(
        session=outcome.session or "",
        reused=outcome.reused,
        tokens=lookup.tokens,
        reason=MISS_REASONS[outcome.reason],
        diverged_at=outcome.diverged_at,
        engine=lookup.engine,
    )


def insert_response(outcome: InsertOutcome) -> pb.InsertResponse:
    return pb.InsertResponse(stored=outcome.stored, reason=INSERT_REFUSALS[outcome.reason])


def stats_response(fleet: FleetStats) -> pb.StatsResponse:
    stats = fleet.total
    s = stats.cache
    return pb.StatsResponse(
        entries=s.entries,
        max_entries=s.max_entries,
        hits=s.hits,
        misses=s.misses,
        inserts=s.inserts,
        dropped_on_restart=stats.dropped_on_restart,
        engine_instance_id=stats.engine_instance_id,
        policy=stats.policy,
        reused_positions=s.reused_tokens,
        refusals={str(reason): count for reason, count in s.refusals.items()},
        max_positions=s.max_positions,
        positions=s.positions,
        engine_share=stats.engine_share,
        pressure_evictions=stats.pressure_evictions,
        pressure_retries=stats.pressure_retries,
        reclaimed=stats.reclaimed,
        routing=fleet.routing,
        misses_by_reason=stats.misses_by_reason,
        engines=[engine_stats(engine) for engine in fleet.engines],
        snapshot_dir=pb.SnapshotDirStats(**asdict(fleet.snapshot_dir)) if fleet.snapshot_dir else None,
    )


def engine_stats(engine: EngineStatus) -> pb.EngineStats:
    c = engine.stats.cache
    return pb.EngineStats(
        engine=engine.name,
        instance_id=engine.instance_id,
        fingerprint=engine.fingerprint,
        routable=engine.routable,
        entries=c.entries,
        positions=c.positions,
        hits=c.hits,
        misses=c.misses,
        in_flight=engine.in_flight,
        load=engine.load,
        routed=engine.routed,
        load_guarded=engine.load_guarded,
    )


def client_event(event: GatewayEvent) -> epb.GenerateEvent:
    """A gateway event as the engine event its client reads."""
    return event_message(event)


# -- engine side ------------------------------------------------------------------------------


def taken_clone(reply: epb.CloneResponse) -> TakenClone:
    """A Clone reply as ``GatewayBackend.take_clone`` answers it."""
    if reply.session:
        return TakenClone(reply.session)
    return TakenClone(None, _CLONE_REFUSALS.get(reply.reason, CloneRefusal.BOUNDARY))


def text_input(text: TextPrompt) -> epb.TextInput:
    return epb.TextInput(
        text=text.text,
        chat=text.chat,
        system=text.system,
        add_special_tokens=text.add_special_tokens,
        messages=[epb.ChatMessage(role=role, content=content) for role, content in text.messages],
    )


def generation_config(config: GenConfig, ignore_eos: bool) -> epb.GenerationConfig:
    """The engine request's config: every field set, so the engine builds the same GenConfig."""
    return epb.GenerationConfig(
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        seed=config.seed,
        stop_tokens=config.stop_tokens,
        ignore_eos=ignore_eos,
        prefill_chunk=config.prefill_chunk,
    )


def engine_request(request: EngineGenerate, snapshot_owner: str = "") -> epb.GenerateRequest:
    """The engine Generate; ``snapshot_owner``: who receives the snapshots ("": the caller)."""
    return epb.GenerateRequest(
        session=request.session,
        tokens=epb.TokenIds(ids=request.tokens),
        config=generation_config(request.config, request.ignore_eos),
        capture=epb.CaptureOptions(
            prompt_snapshot=request.prompt_snapshot,
            breakpoints=request.config.prefill_breakpoints,
            snapshot_owner=snapshot_owner,
        ),
    )
