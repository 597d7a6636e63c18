"""One attempt on the fleet's engines: a prompt tokenized by the first engine that answers, a call passed
along the route while engines fail before serving, a generation started on one engine (its load and
the rates it feeds)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from engine_service.api.call_context import CallContext
from engine_service.api.errors import ForklineError, ResourceExhausted, Unavailable
from engine_service.api.prompts import TextPrompt, Tokenized
from engine_service.api.stream_events import Done
from prefix_service.fleet.member import EngineMember, RoutedStream
from prefix_service.fleet.rates import RateMeter
from prefix_service.gateway.calls import GatewayRequest, Prompt

log = logging.getLogger(__name__)

# Failures before the first event that another engine may not share: the request moves on.
RETRY_ELSEWHERE = (Unavailable, ResourceExhausted)


def started_on(
    rates: RateMeter, member: EngineMember, routed: GatewayRequest, call: CallContext, reused: int
) -> RoutedStream:
    """``routed`` started on ``member``, which reuses ``reused`` positions; its first token's time feeds
    ``rates``."""
    load, ahead, started_at = member.load, member.pending, time.perf_counter()  # what was ahead of it
    positions = len(routed.prompt) - reused

    def measured(done: Done, ttft_s: float) -> None:
        rates.observe(load, done.prompt_positions, ttft_s, ahead)

    member.started(positions)
    try:
        return RoutedStream(member.gateway.generate(routed, call), member, measured, started_at, positions)
    except BaseException:
        member.prefilled(positions)
        member.ended()
        raise


def tokenized_by_first(
    prompt: Prompt, call: CallContext, engines: Sequence[EngineMember], wanted_ends: int
) -> Tokenized:
    """Token ids as given, or the text tokenized (with up to ``wanted_ends`` message ends) by the first
    engine that answers."""
    if not isinstance(prompt, TextPrompt):
        return Tokenized(tuple(prompt))

    def tokenize_on(member: EngineMember) -> Tokenized:
        return member.gateway.tokenized(prompt, call, wanted_ends)

    return first_that_serves(engines, tokenize_on, retry=(Unavailable,))


def first_that_serves(
    engines: Sequence[EngineMember],
    call: Callable[[EngineMember], object],
    retry: tuple[type[ForklineError], ...] = RETRY_ELSEWHERE,
):
    """``call`` on each engine in turn until one does not fail with a ``retry`` error."""
    for i, member in enumerate(engines):
        try:
            return call(member)
        except retry as exc:
            if i == len(engines) - 1:
                raise
            log.info("engine %s could not serve (%s): trying %s", member.name, exc, engines[i + 1].name)
    raise Unavailable("no engine to route to")
