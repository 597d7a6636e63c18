"""Starting a generation: resolve or open its session, check its input against the engine, and
reserve what it may hold in its owner's quota before anything runs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from engine_service.api.checks import checked_int
from engine_service.api.config import GenConfig
from engine_service.api.errors import FailedPrecondition, InvalidArgument, Stopping
from engine_service.executors.grammar import with_grammar
from engine_service.sessions.capture import SnapshotCapture
from engine_service.sessions.generation_call import GenerationCall
from engine_service.sessions.inputs import Input, check_fits, fed_input, input_size
from engine_service.sessions.ownership import payer_of, receiver_of
from engine_service.sessions.reservation import GrowingReservation

if TYPE_CHECKING:
    from engine_service.api.limits import EngineLimits
    from engine_service.model.text.chat import ChatFormatter
    from engine_service.model.text.tokenizer import Tokenizer
    from engine_service.runtime.runner import Runner
    from engine_service.runtime.session import Session
    from engine_service.sessions.handles import HandleRegistry


class GenerationHost(Protocol):
    """What starting a generation reads of the engine's sessions (``EngineSessions``)."""

    runner: Runner
    registry: HandleRegistry[Session]
    tokenizer: Tokenizer
    chat: ChatFormatter | None
    limits: EngineLimits
    reservation_growth: int | None


@dataclass(frozen=True)
class GenerationRequest:
    """``input`` fed to ``session`` ("": a fresh one, closed after the call unless ``keep_session``);
    its snapshots belong to ``snapshot_owner`` ("": the caller)."""

    input: Input
    config: GenConfig
    session: str = ""
    keep_session: bool = False
    close_session: bool = False
    prompt_snapshot: bool = False
    snapshot_owner: str = ""
    final_snapshot: bool = False  # a snapshot at the last committed token when it ends (``capture.py``)
    checkpoint_every: int = 0  # a snapshot every N generated tokens (decode checkpoints; 0: none)


def start_generation(engine: GenerationHost, owner: str, request: GenerationRequest) -> GenerationCall:
    """The call for ``request``; every refusal comes before anything is allocated or reserved."""
    limits, registry = engine.limits, engine.registry
    value = fed_input(request.input, engine.tokenizer.scoped(owner), engine.chat, limits.vocab_size)
    # a json_schema compiled for this tokenizer now: an unsupported schema fails before anything runs
    config, size = with_grammar(request.config, engine.tokenizer), input_size(value)
    config = replace(config, draft_scope=owner)  # a suffix drafter drafts only from this owner's texts
    every = checked_int("capture.checkpoint_every", request.checkpoint_every, 0, None)
    persistent = registry.persistent_owners
    snapshot_owner = receiver_of(owner, request.snapshot_owner, "capture.snapshot_owner", persistent)
    if request.close_session and not request.session:
        raise InvalidArgument("close_session only applies to a given session (session is empty)")
    if request.session:
        if request.keep_session:
            raise InvalidArgument("keep_session only applies to a fresh session (session is set)")
        handle, fresh, session = request.session, False, registry.pin(request.session, owner)
    else:
        check_fits(0, size, config.prefill_breakpoints, limits)  # before anything is reserved
        handle, fresh = registry.reserve(owner, _reservation(engine, "", 0, size, config).initial), True
        session = _open(engine, handle, owner)
    capture = SnapshotCapture(
        registry,
        session,
        snapshot_owner,
        payer=payer_of(owner, snapshot_owner, persistent),
        prompt_snapshot=request.prompt_snapshot,
        breakpoints=config.prefill_breakpoints,
        final_snapshot=request.final_snapshot,
        checkpoint_every=every,
    )
    try:
        if session.generating:
            raise FailedPrecondition(f"session {handle} is already generating")
        start = session.position + (1 if session.has_pending else 0)
        check_fits(start, size, config.prefill_breakpoints, limits)
        reservation = _reservation(engine, handle, start, size, config)
        registry.weigh(handle, reservation.initial, check=True)
        capture.reserve(start + size, owner)
    except BaseException:
        capture.release()
        registry.unpin(handle)
        if fresh:
            registry.discard(handle)
            session.close()
        raise
    return GenerationCall(
        registry=registry,
        handle=handle,
        session=session,
        fresh=fresh,
        keep_session=request.keep_session,
        close_session=request.close_session,
        tokenizer=engine.tokenizer,
        input=value,
        config=config,
        capture=capture,
        reservation=reservation,
    )


def _open(engine: GenerationHost, handle: str, owner: str) -> Session:
    try:
        session = engine.runner.open_session()
    except BaseException:
        engine.registry.discard(handle)
        raise
    if not engine.registry.fill(handle, session):
        session.close()
        raise Stopping("the engine is shutting down")
    engine.registry.pin(handle, owner)
    return session


def _reservation(
    engine: GenerationHost, handle: str, start: int, size: int, config: GenConfig
) -> GrowingReservation:
    return GrowingReservation(
        engine.registry,
        handle,
        start=start,
        size=size,
        max_new_tokens=config.max_new_tokens,
        max_session_tokens=engine.limits.max_session_tokens,
        growth=engine.reservation_growth,
    )
