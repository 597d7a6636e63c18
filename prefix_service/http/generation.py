"""One HTTP request's generation as the handlers read it: started, text deltas cut at stop strings, a
finish reason and the usage.

:meth:`Generation.start` waits for the engine's ``Started`` event, so everything that can fail before
the first token (bad input, engines full or down) fails before a streaming response commits to
status 200. :meth:`Generation.deltas` yields text; a stop string ends the generation in the engine at
once (finish reason ``stop``). :meth:`Generation.close` (always called, also when the client left)
ends a generation that has not finished, so no engine session outlives the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from engine_service.api.errors import Unavailable
from engine_service.api.stream_events import Done, Started, Tokens
from engine_service.serving.tokens import Caller
from prefix_service.fleet.fleet import Fleet
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.http.bridge import GenerationBridge
from prefix_service.http.convert import FINISH_REASONS, usage
from prefix_service.http.protocol import Usage
from prefix_service.http.stop_strings import StopMatcher


class Generation:
    def __init__(
        self, gateway: Fleet, request: GatewayRequest, stops: Sequence[str], owner: str, caller: Caller | None
    ) -> None:
        self._bridge = GenerationBridge(gateway, request, owner, caller)
        self._stops = StopMatcher(stops)
        self._started: Started | None = None
        self._finished = False
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    async def start(self) -> None:
        """Start the generation and wait until the engine runs it; a refusal raises."""
        self._bridge.start()
        event = await self._bridge.next()
        if not isinstance(event, Started):  # the gateway always starts with Started
            raise Unavailable("the engine stream ended before the generation started")
        self._started = event

    async def deltas(self) -> AsyncIterator[str]:
        """The generated text, piece by piece; ``finish_reason`` is set when it ends."""
        while (event := await self._bridge.next()) is not None:
            if isinstance(event, Tokens):
                self.completion_tokens += len(event.ids)
                text, stopped = self._stops.push(event.text)
                if text:
                    yield text
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
                if tail:
                    yield tail
                self._finish(FINISH_REASONS[event.finish_reason])
                return
        raise Unavailable("the engine stream ended without a done event")

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
