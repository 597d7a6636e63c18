"""One attempt to start a gateway Generate: room for its snapshots, the lookup, the engine call as the
caller, its first event (where the engine's refusal, e.g. RESOURCE_EXHAUSTED, arrives)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from engine_service.api.call_context import CallContext
from engine_service.api.engine_info import EngineInfo
from engine_service.api.errors import InvalidArgument
from engine_service.api.stream_events import SnapshotKind
from prefix_service.cache.budget import Reservation
from prefix_service.cache.checkpoints import CheckpointPlan, SnapshotRoom, checkpoint_positions
from prefix_service.cache.outcomes import InsertRefusal, LookupOutcome, Match
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.cache.retention import BOUNDARY_KEY
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.gateway.gateway_backend import EngineGenerate, EngineStream, GatewayBackend
from prefix_service.gateway.inflight import InflightPrefills
from prefix_service.gateway.stream import GatewayStream, StreamHost


class StartHost(StreamHost, Protocol):
    """What starting a generation asks of its gateway (``Gateway``)."""

    cache: PrefixCache
    backend: GatewayBackend
    cache_generated: bool  # store each generation's final snapshot (prompt + answer) too
    inflight: InflightPrefills

    @property
    def engine(self) -> EngineInfo: ...

    def checkpoint_plan(self) -> CheckpointPlan: ...

    def find(
        self, namespace: str, tokens: Sequence[int], call: CallContext, *, count: bool = True
    ) -> LookupOutcome: ...


def start_generation(
    gateway: StartHost,
    request: GatewayRequest,
    tokens: list[int],
    message_ends: Sequence[int],
    call: CallContext,
) -> GatewayStream:
    """Wait for a prefix of the prompt being prefilled (``inflight.py``), reserve room for the prompt
    snapshot, look up (the clone is the caller's), reserve room for the
    checkpoints and explicit breakpoints past the match, start the engine Generate and read its first
    event."""
    check_breakpoints(request.breakpoints, len(tokens))
    # join a prefix being prefilled, or register this prompt's prefill (``inflight.py``)
    prefill = gateway.inflight.claim(
        request.namespace, tokens, call, request.caller_active, register=request.store_prompt
    )
    cache = gateway.cache
    room = SnapshotRoom()
    capture = request.store_prompt and cache.max_entries > 0  # a disabled cache: no snapshot at all
    match: Match | None = None
    stream: EngineStream | None = None
    try:  # from the claim on: a failure ends the registered prefill
        if capture:
            reserved = cache.reserve(request.namespace, tokens, request.metadata)
            if isinstance(reserved, Reservation):
                room.add(len(tokens), reserved)
            else:  # no room the policy would give it: no prompt snapshot
                cache.record_refusal(reserved)
        match = gateway.find(request.namespace, tokens, call, count=request.count_lookup).match
        reused = match.reused if match else 0
        config = request.config
        if capture:
            breakpoints = _reserve_checkpoints(gateway, request, tokens, message_ends, reused, room)
            breakpoints += _reserve_breakpoints(gateway, request, tokens, reused, room)
            if breakpoints:
                breakpoints = tuple(sorted(set(breakpoints)))
                config = replace(config, prefill_breakpoints=breakpoints)
        prefill = gateway.inflight.confirm(prefill, reused, room.holds(len(tokens)))
        stream = gateway.backend.generate(
            EngineGenerate(
                session=match.session if match else "",
                tokens=tuple(tokens[reused:]),
                config=config,
                ignore_eos=request.ignore_eos,
                prompt_snapshot=room.holds(len(tokens)),
                call=call,
                close_session=match is not None,  # the match is the call's: the engine closes it
                final_snapshot=capture and gateway.cache_generated,  # its room reserved as it comes
                checkpoint_every=gateway.cadence.stride() if capture else 0,
            )
        )
        stream = gateway.inflight.track(stream, prefill)
        first = next(stream, None)
    except BaseException:
        gateway.inflight.end(prefill)
        room.release()
        if stream is not None:
            stream.cancel()
        if match is not None:  # after the call's deadline too: the clone is the caller's to let go
            gateway.close_session(match.session, CallContext(call.owner, call.credential))
        raise
    return GatewayStream(gateway, stream, request, tokens, match, call, first, room)


def check_breakpoints(breakpoints: Sequence[int], prompt_length: int) -> None:
    """Explicit breakpoints lie inside the prompt: (0, prompt_length]."""
    for i, position in enumerate(breakpoints):
        if not 0 < position <= prompt_length:
            raise InvalidArgument(
                f"breakpoints[{i}] = {position} is outside the prompt's {prompt_length} positions"
            )


def _reserve_breakpoints(
    gateway: StartHost, request: GatewayRequest, tokens: Sequence[int], reused: int, room: SnapshotRoom
) -> tuple[int, ...]:
    """The request's explicit breakpoints strictly between ``reused`` and the prompt end (the end is
    the prompt snapshot), on any engine: each an entry of its own, so the breakpoint's prefix stays
    stored when the longer prompt is evicted; one already stored, or given no room, is not asked for."""
    wanted = []
    metadata = {**request.metadata, BOUNDARY_KEY: SnapshotKind.BREAKPOINT}
    for position in sorted(set(request.breakpoints)):
        if not reused < position < len(tokens) or room.holds(position):
            continue
        reserved = gateway.cache.reserve(request.namespace, tokens[:position], metadata)
        if isinstance(reserved, Reservation):
            room.add(position, reserved)
            wanted.append(position)
        elif reserved is not InsertRefusal.DUPLICATE:
            gateway.cache.record_refusal(reserved)
    return tuple(wanted)


def _reserve_checkpoints(
    gateway: StartHost,
    request: GatewayRequest,
    tokens: Sequence[int],
    message_ends: Sequence[int],
    reused: int,
    room: SnapshotRoom,
) -> tuple[int, ...]:
    """The breakpoints to ask the engine for (``cache/checkpoints.py``): only where the engine's cache
    evicts window rows, at message ends and branch points past ``reused``, fewer than half the cache's
    entries, each with room reserved (one the policy gives no room, or one already stored, is not
    asked for)."""
    cache = gateway.cache
    if not gateway.engine.window.evicts:
        return ()
    plan = gateway.checkpoint_plan()
    if not plan.enabled or len(tokens) - reused < 2:
        return ()  # nothing lies strictly between the match and the prompt end
    wanted = []
    metadata = {**request.metadata, BOUNDARY_KEY: SnapshotKind.BREAKPOINT}
    forks = cache.branch_points(request.namespace, tokens)
    for position in checkpoint_positions(plan, len(tokens), reused, message_ends, forks):
        reserved = cache.reserve(request.namespace, tokens[:position], metadata)
        if isinstance(reserved, Reservation):
            room.add(position, reserved)
            wanted.append(position)
        elif reserved is not InsertRefusal.DUPLICATE:
            cache.record_refusal(reserved)
    return tuple(wanted)
