"""ResumingStream: a gateway generation that outlives its engine. The fleet keeps the prompt's ids, every
id streamed and the sampling configuration; when the engine serving the stream fails mid-stream
(``engine_failed``: connection lost, killed, stopping; or a generation the engine cancelled that the
client did not), it starts the generation again on another engine over prompt + streamed ids, with
``drawn_tokens`` = the ids streamed so the sampler and a grammar go on where they were, and continues
the same stream: the client sees a pause, never an error, a repeated or a missing token. At most
``max_resumes`` per generation, then the error it would have had. Spec: docs/RESUME.md."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Collection, Generator
from dataclasses import replace

from engine_service.api.errors import Cancelled, ForklineError, Unavailable
from engine_service.api.stream_events import Done, FinishReason, Started, Tokens
from prefix_service.fleet.member import RoutedStream
from prefix_service.gateway.calls import GatewayEvent, GatewayRequest

log = logging.getLogger(__name__)

MAX_RESUMES = 2  # --max_resumes: resumes per generation

# (the request to start, the engines to avoid) -> a started stream (the fleet routes it)
Start = Callable[[GatewayRequest, frozenset[str]], RoutedStream]
# a hand-off's start: also the engine whose prompt snapshot moves to the chosen one ("": none)
HandOff = Callable[[GatewayRequest, frozenset[str], str], RoutedStream]


class ResumingStream:
    """Iterate it once for the client's events; :meth:`stop` (any thread) when the client leaves.
    ``request.prompt`` holds token ids (the fleet tokenized it); ``stops``: the ids that end the
    generation (its stop tokens, else the model's EOS), so a stream cut right after one ends there.
    ``hand_off`` (a split fleet, ``handoff.py``): ``start`` runs the prompt and the first token, then
    the rest streams from a ``hand_off`` start, as a resume does, and later resumes start there too."""

    def __init__(
        self,
        start: Start,
        request: GatewayRequest,
        stops: Collection[int],
        max_resumes: int,
        hand_off: HandOff | None = None,
    ) -> None:
        self._start, self._request, self._max = start, request, max_resumes
        self._hand_off = hand_off
        self._stops = frozenset(stops)
        self._stopped = False
        self._failed: set[str] = set()
        self._stream = start(request, frozenset())  # an engine that fails before this passes it on

    @property
    def engine(self) -> str:
        return self._stream.engine

    def stop(self) -> None:
        """The client went away: end the generation where it runs now (no resume after this)."""
        self._stopped = True
        self._stream.stop()

    def __iter__(self) -> Generator[GatewayEvent, None, None]:
        streamed: list[int] = []
        started: Started | None = None
        resumes, recomputed, pause, handed = 0, 0, 0.0, False
        began, first_token_at, failed_at = time.perf_counter(), 0.0, 0.0
        while True:
            finished = hand_now = False
            try:
                for event in _closing(iter(self._stream)):
                    if failed_at and not isinstance(event, Started):
                        pause, failed_at = pause + time.perf_counter() - failed_at, 0.0
                    if isinstance(event, Started):
                        if started is None:
                            started = event
                            yield event
                        elif resumes:
                            recomputed += event.input_positions  # the resume's prefill
                        continue
                    if isinstance(event, Tokens):
                        first_token_at = first_token_at or time.perf_counter()
                        streamed.extend(event.ids)
                        yield event
                        continue
                    if event.finish_reason is FinishReason.CANCELLED and not self._stopped:
                        raise Unavailable(f"engine {self._stream.engine} cancelled the generation")
                    if self._handing_off(event, streamed, handed):
                        handed = hand_now = True  # the prefill half ended: the rest streams elsewhere
                        continue
                    if resumes or handed:
                        event = replace(
                            event,
                            prompt_positions=started.input_positions if started else event.prompt_positions,
                            reused_positions=started.position if started else event.reused_positions,
                            generated_tokens=len(streamed),
                            time_to_first_token_s=(first_token_at or time.perf_counter()) - began,
                            total_s=time.perf_counter() - began,
                            resumes=resumes,
                            resumed_positions=recomputed,
                            resume_pause_s=pause,
                        )
                    yield event
                    finished = True  # the engine stream ends after its Done: read it to its end
                if finished:
                    return
                if hand_now and self._hand_off is not None:
                    source, hand_off = self._stream.engine, self._hand_off
                    self._start = functools.partial(_no_source, hand_off)  # resumes start there too
                    self._stream = hand_off(self._resumed(streamed), frozenset(), source)
                    if self._stopped:
                        self._stream.stop()
                    continue
                raise Unavailable(f"engine {self._stream.engine} ended the stream without Done")
            except ForklineError as exc:
                if not engine_failed(exc) or self._stopped or resumes >= self._max:
                    raise
                failed_at = failed_at or time.perf_counter()
                self._failed.add(self._stream.engine)
                ended = self._ended(streamed, started, resumes, recomputed, began, first_token_at)
                if ended is not None:
                    yield ended
                    return
                resumes += 1
                log.warning("engine %s failed mid-stream (%s): resume %d", self._stream.engine, exc, resumes)
                try:
                    self._stream = self._start(self._resumed(streamed), frozenset(self._failed))
                except ForklineError:
                    raise exc from None
                if self._stopped:  # the client left while the resume started
                    self._stream.stop()

    def _handing_off(self, done: Done, streamed: list[int], handed: bool) -> bool:
        """Whether ``done`` ends the prefill half of a split generation (its first token sent, more to
        come): the rest is handed off."""
        return (
            self._hand_off is not None
            and not handed
            and done.finish_reason is FinishReason.LENGTH
            and 0 < len(streamed) < self._request.config.max_new_tokens
        )

    def _resumed(self, streamed: list[int]) -> GatewayRequest:
        """The request over prompt + ``streamed``: the rest of the budget, ``drawn_tokens`` on."""
        request, config = self._request, self._request.config
        return replace(
            request,
            prompt=[*request.prompt, *streamed],
            config=replace(
                config,
                max_new_tokens=config.max_new_tokens - len(streamed),
                drawn_tokens=config.drawn_tokens + len(streamed),
            ),
            count_lookup=False,  # the request was counted once, at its start
        )

    def _ended(
        self,
        streamed: list[int],
        started: Started | None,
        resumes: int,
        recomputed: int,
        began: float,
        first_token_at: float,
    ) -> Done | None:
        """The Done a stream cut after its last token would have had (every token streamed, or a stop
        token last), else None: there is more to generate."""
        if streamed and streamed[-1] in self._stops:
            reason = FinishReason.STOP
        elif len(streamed) >= self._request.config.max_new_tokens:
            reason = FinishReason.LENGTH
        else:
            return None
        now = time.perf_counter()
        return Done(
            reason,
            started.input_positions if started else 0,
            started.position if started else 0,
            len(streamed),
            (started.position + started.input_positions if started else 0) + len(streamed) - 1,
            (first_token_at or now) - began,
            0.0,
            now - began,
            engine=self._stream.engine,
            resumes=resumes,
            resumed_positions=recomputed,
        )


def _no_source(hand_off: HandOff, request: GatewayRequest, avoid: frozenset[str]) -> RoutedStream:
    return hand_off(request, avoid, "")


def engine_failed(exc: ForklineError) -> bool:
    """Whether ``exc`` from a running engine stream says the engine failed, not the request: UNAVAILABLE
    (connection lost, engine stopping), CANCELLED by the engine, or a status with no forkline meaning
    (INTERNAL or UNKNOWN: a stream cut by a killed process can end so)."""
    return isinstance(exc, (Unavailable, Cancelled)) or type(exc) is ForklineError


def _closing(events: Generator[GatewayEvent, None, None]) -> Generator[GatewayEvent, None, None]:
    """``events``, closed (its cleanup run) however the loop over them ends."""
    with contextlib.closing(events):
        yield from events
