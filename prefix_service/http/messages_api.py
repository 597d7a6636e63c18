"""Anthropic's Messages API on the HTTP door: ``POST /v1/messages`` (whole or streamed) and
``POST /v1/messages/count_tokens``, ``x-api-key`` or bearer auth, errors in Anthropic's shape;
``cache_control`` blocks are prefill breakpoints the prefix cache stores. Spec:
docs/HTTP.md#anthropics-messages-api."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine_service.api.call_context import CallContext
from engine_service.api.errors import InvalidArgument
from engine_service.serving.tokens import check_token
from prefix_service.http.disconnect import until_disconnected
from prefix_service.http.errors import ApiError, answering_errors
from prefix_service.http.generation import Generation
from prefix_service.http.messages_convert import (
    Rendering,
    breakpoint_position,
    gateway_request,
    render,
    stop_sequences,
    usage,
)
from prefix_service.http.messages_errors import error_response
from prefix_service.http.messages_protocol import CountTokensRequest, MessagesRequest
from prefix_service.http.messages_stream import MessageShape

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def routes(door: Any) -> list[Route]:
    """The routes over ``door`` (app.py's _Door); they answer errors in Anthropic's shape."""
    api = _MessagesApi(door)
    return [
        Route("/v1/messages", answering_errors(api.create, error_response), methods=["POST"]),
        Route(
            "/v1/messages/count_tokens", answering_errors(api.count_tokens, error_response), methods=["POST"]
        ),
    ]


class _MessagesApi:
    def __init__(self, door: Any) -> None:
        self.door = door

    async def create(self, request: Request) -> Response:
        call = self.authenticate(request)
        body = MessagesRequest.model_validate_json(await request.body())
        self.door._check_model(body.model)
        rendering = render(body, self.door.fleet.chat_template)
        stops = stop_sequences(body)
        call, scope = self.door._scoped(call)
        breakpoints = await self._breakpoints(rendering, call)
        generation = Generation(
            self.door.fleet, gateway_request(body, rendering, breakpoints, scope), stops, call
        )
        shape = MessageShape(
            self.door.model_name,
            rendering.plan,
            lambda output: usage(generation.started, breakpoints, output),
        )
        try:
            await until_disconnected(request, generation.start(), generation.close)
            if not body.stream:
                message = await until_disconnected(request, shape.whole(generation), generation.close)
                return JSONResponse(message)
        except BaseException:
            generation.close()
            raise
        return StreamingResponse(
            shape.events(generation), media_type="text/event-stream", headers=SSE_HEADERS
        )

    async def count_tokens(self, request: Request) -> Response:
        call = self.authenticate(request)
        body = CountTokensRequest.model_validate_json(await request.body())
        self.door._check_model(body.model)
        tokens = await asyncio.to_thread(
            self.door.fleet.tokenize, render(body, self.door.fleet.chat_template).prompt, call
        )
        return JSONResponse({"input_tokens": len(tokens.ids)})

    async def _breakpoints(self, rendering: Rendering, call: CallContext) -> tuple[int, ...]:
        """The positions of the request's cache_control blocks in its prompt (one Tokenize of the whole
        prompt and one per breakpoint's conversation up to its block)."""
        if not rendering.cuts:
            return ()
        fleet = self.door.fleet

        def positions() -> tuple[int, ...]:
            prompt = fleet.tokenize(rendering.prompt, call).ids
            cuts = [breakpoint_position(prompt, fleet.tokenize(c.prompt, call).ids) for c in rendering.cuts]
            return tuple(sorted({p for p in cuts if p > 0}))

        return await asyncio.to_thread(positions)

    def authenticate(self, request: Request) -> CallContext:
        """``x-api-key: <token>`` (Anthropic's header) or ``Authorization: Bearer <token>``, the same
        owner table as the rest of the door."""
        key = request.headers.get("x-api-key", "").strip()
        door = self.door
        if door.auth is not None and not key and not request.headers.get("authorization"):
            raise ApiError(401, "missing 'x-api-key: <token>' (or 'Authorization: Bearer <token>') header")
        if door.auth is None or not key:
            return door._authenticate(request)
        try:
            owner = door.auth.owner_for(check_token(key, "x-api-key"))
        except InvalidArgument as exc:
            raise ApiError(401, f"malformed x-api-key: {exc}") from None
        if owner is None:
            raise ApiError(401, "unknown x-api-key")
        return CallContext(owner, f"Bearer {key}")
