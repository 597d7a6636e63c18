"""The prefix service's requests (``prefix_pb2``) <-> gateway values, and gateway answers -> responses.
Pure functions. The gateway's events for its client are engine ``GenerateEvent`` messages; the engine
calls' own messages are ``engine_service/serving/engine_wire``'s."""

from __future__ import annotations

from dataclasses import asdict

from engine_service.api.errors import InvalidArgument
from engine_service.serving.engine_wire import event_message, gen_config, text_prompt
from prefix_service.cache.events import CacheEvent, EventKind
from prefix_service.cache.outcomes import InsertOutcome, InsertRefusal, MissReason
from prefix_service.fleet.stats import EngineStatus, FleetStats
from prefix_service.gateway.calls import GatewayEvent, GatewayRequest, Prompt, PromptLookup
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

EVENT_KINDS: dict[EventKind, pb.CacheEventKind.ValueType] = {
    kind: pb.CacheEventKind.Value(f"CACHE_EVENT_KIND_{kind.name}") for kind in EventKind
}


def prompt(request: pb.LookupRequest | pb.GatewayGenerateRequest) -> Prompt:
    """The request's input: token ids (checked later against the engine's vocabulary) or text."""
    which = request.WhichOneof("input")
    if which == "tokens":
        return list(request.tokens.ids)
    if which == "text":
        return text_prompt(request.text)
    raise InvalidArgument("input is required: one of tokens, text")


def gateway_request(request: pb.GatewayGenerateRequest, namespace: str) -> GatewayRequest:
    """The gateway call in ``namespace`` (the caller's scope of ``request.namespace``); the config is
    checked here (InvalidArgument before any lookup). Its stop tokens stay as sent: the engine adds its
    EOS tokens unless ``ignore_eos``."""
    return GatewayRequest(
        namespace=namespace,
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
        bytes_held=s.bytes_held,
        max_bytes=s.max_bytes,
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
        moves_in=engine.moves_in,
        moves_out=engine.moves_out,
        move_refusals=engine.move_refusals,
    )


def client_event(event: GatewayEvent) -> epb.GenerateEvent:
    """A gateway event as the engine event its client reads."""
    return event_message(event)


def cache_event(event: CacheEvent) -> pb.CacheEvent:
    return pb.CacheEvent(
        kind=EVENT_KINDS[event.kind],
        sequence=event.sequence,
        engine=event.engine,
        engine_instance_id=event.instance_id,
        time=event.time,
        namespace=event.scope,
        positions=event.positions,
        digest=event.digest,
        replayed=event.replayed,
        missed=event.missed,
        replica=event.replica,
        source_engine=event.source,
    )
