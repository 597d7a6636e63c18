"""One HTTP request's generation as the handlers read it: ``start`` waits for the engine's ``Started`` (so
what fails before the first token fails before a stream commits to 200), ``deltas`` yields text cut at
stop strings with its log probabilities, ``close`` ends it so no engine session outlives the request."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from engine_service.api.call_context import CallContext
from engine_service.api.errors import InvalidJsonSchema, Unavailable
from engine_service.api.logprobs import TokenLogprob
from engine_service.api.stream_events import Done, Started, Tokens
from prefix_service.fleet.fleet import Fleet
from prefix_service.gateway.calls import GatewayEvent, GatewayRequest
from prefix_service.http.bridge import GenerationBridge
from prefix_service.http.convert import FINISH_REASONS, usage
from prefix_service.http.errors import BadField
from prefix_service.http.protocol import Usage
from prefix_service.http.stop_strings import StopMatcher


@dataclass(frozen=True)
class Delta:
    """A piece of the generated text and the log probabilities of the tokens behind it."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


class Generation:
    def __init__(
        self, fleet: Fleet, request: GatewayRequest, stops: Sequence[str], call: CallContext
    ) -> None:
        self._bridge = GenerationBridge(fleet, request, call)
        self._stops = StopMatcher(stops)
        self._started: Started | None = None
        self._ahead: deque[GatewayEvent | None] = deque()  # events prime() read before deltas()
        self._finished = False
        self.completion_tokens = 0
        self.ids: list[int] = []  # every generated id (the end-of-sequence one included)
        self.finish_reason: str | None = None

    async def start(self) -> None:
        """Start the generation and wait until the engine runs it; a refusal raises."""
        self._bridge.start()
        try:
            event = await self._bridge.next()
        except InvalidJsonSchema as exc:  # the engine could not compile the schema
            raise BadField("response_format", str(exc)) from None
        if not isinstance(event, Started):  # the gateway always starts with Started
            raise Unavailable("the engine stream ended before the generation started")
        self._started = event

    @property
    def started(self) -> Started:
        if self._started is None:
            raise RuntimeError("started before start()")
        return self._started

    async def prime(self) -> None:
        """Read ahead until the first tokens (or the end); :meth:`deltas` yields them as usual."""
        while True:
            event = await self._bridge.next()
            self._ahead.append(event)
            if event is None or isinstance(event, (Tokens, Done)):
                return

    async def _next(self) -> GatewayEvent | None:
        return self._ahead.popleft() if self._ahead else await self._bridge.next()

    async def deltas(self) -> AsyncIterator[Delta]:
        """The generated text, piece by piece; ``finish_reason`` is set when it ends."""
        held: list[TokenLogprob] = []  # log probabilities whose text the stop matcher holds back
        while (event := await self._next()) is not None:
            if isinstance(event, Tokens):
                self.completion_tokens += len(event.ids)
                self.ids += event.ids
                held += event.logprobs
                text, stopped = self._stops.push(event.text)
                if text:
                    yield Delta(text, tuple(held[:-1]))
                    held = held[-1:]
                if stopped:
                    self._bridge.stop()  # the engine generation ends now; the bridge cleans up
                    self._finish("stop")
                    return
            elif isinstance(event, Done):
                if event.finish_reason not in FINISH_REASONS:
                    raise Unavailable(
                        f"the generation ended early ({event.finish_reason}): the engine is stopping"
                    )
                tail = self._stops.flush()
                if event.finish_reason == "stop":
                    held = held[:-1]  # the end-of-sequence (stop) token
                if tail or held:
                    yield Delta(tail, tuple(held))
                self._finish(FINISH_REASONS[event.finish_reason])
                return
        raise Unavailable("the engine stream ended without a done event")

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the text (None: none did)."""
        return self._stops.matched

    def usage(self) -> Usage:
        if self._started is None:
            raise RuntimeError("usage() before start()")
        return usage(self._started, self.completion_tokens)

    def close(self) -> None:
        """End the generation unless it finished (idempotent)."""
        if not self._finished:
            self._finished = True
            self._bridge.stop()

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._finished = True
