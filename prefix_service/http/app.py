"""The OpenAI-compatible HTTP door as a Starlette app over the prefix service's :class:`Fleet`: chat and
text completions (streamed as server-sent events or whole), models, health; every error as OpenAI's
error JSON (``errors.py``). Spec: docs/HTTP.md."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import PurePath
from typing import Protocol, TypeVar

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine_service.api.call_context import CallContext
from engine_service.api.errors import InvalidArgument
from engine_service.api.owners import DEFAULT_OWNER
from engine_service.serving.tokens import check_token
from prefix_service.fleet.fleet import Fleet
from prefix_service.gateway.calls import Prompt
from prefix_service.gateway.tenancy import Tenancy, Tenant
from prefix_service.http import convert, messages_api, responses_api, token_routes
from prefix_service.http.choices import Choices
from prefix_service.http.disconnect import until_disconnected
from prefix_service.http.errors import ApiError, answering_errors, error_event, error_response
from prefix_service.http.protocol import ChatCompletionRequest, CompletionRequest, Model, ModelList
from prefix_service.http.responses import DONE_EVENT, ChatShape, CompletionShape, Shape, event

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Body = TypeVar("Body", bound=BaseModel)


class OwnerTable(Protocol):
    def owner_for(self, token: str) -> str | None: ...


def unauthenticated_owner() -> str:
    """The owner of one request without credentials: an owner of its own (self-declared owners would
    make a per-owner quota protect nobody, and one shared ``anonymous`` quota refuse concurrency)."""
    return f"{DEFAULT_OWNER}-{secrets.token_hex(8)}"


def served_model_name(engine_model: str) -> str:
    """The model id clients send, from the engine's model (a path): its file or folder name without a
    ``.gguf`` suffix (``/x/SmolLM2-135M-Instruct-Q4_1.gguf`` -> ``SmolLM2-135M-Instruct-Q4_1``)."""
    name = PurePath(engine_model.rstrip("/\\")).name or engine_model
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def create_app(
    fleet: Fleet,
    *,
    model_name: str,
    auth: OwnerTable | None = None,
    tenancy: Tenancy | None = None,
    namespace: str = convert.NAMESPACE,
) -> Starlette:
    """The ASGI app serving ``fleet`` under the model id ``model_name``. ``auth``: tokens -> owners
    (every route but ``/health`` then needs a bearer token); ``namespace``: the one every request
    uses, scoped as on gRPC (``gateway/tenancy.py``)."""
    door = _Door(fleet, model_name, auth, tenancy or Tenancy(), namespace)
    routes = [
        Route("/v1/chat/completions", answering_errors(door.chat_completions), methods=["POST"]),
        Route("/v1/completions", answering_errors(door.completions), methods=["POST"]),
        Route("/v1/models", answering_errors(door.models), methods=["GET"]),
        Route("/health", answering_errors(door.health), methods=["GET"]),
        *token_routes.routes(door),  # /tokenize, /detokenize
        *responses_api.routes(door),  # /v1/responses (OpenAI's error shape)
        *messages_api.routes(door),  # /v1/messages (Anthropic's error shape)
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _on_http_exception})


async def _on_http_exception(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (unknown route, wrong method) in OpenAI's shape."""
    what = "route" if exc.status_code == 404 else "method"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(ApiError(exc.status_code, message, code=f"unknown_{what}"))


class _Door:
    def __init__(
        self, fleet: Fleet, model_name: str, auth: OwnerTable | None, tenancy: Tenancy, namespace: str
    ) -> None:
        self.fleet, self.model_name, self.auth = fleet, model_name, auth
        self.tenancy, self.namespace = tenancy, namespace
        self.created = int(time.time())

    # -- routes --------------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        call = self._authenticate(request)
        body = await _parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        convert.check_chat(body)
        return await self._complete(
            request,
            body,
            convert.served(
                convert.chat_prompt(body.messages, convert.chat_tools(body)), self.fleet.chat_template
            ),
            call,
            ChatShape(self.model_name, self._fingerprint(), bool(body.logprobs), convert.chat_tools(body)),
        )

    async def completions(self, request: Request) -> Response:
        call = self._authenticate(request)
        body = await _parse(request, CompletionRequest)
        self._check_model(body.model)
        convert.check_completion(body)
        return await self._complete(
            request,
            body,
            convert.completion_prompt(body.prompt),
            call,
            CompletionShape(self.model_name, self._fingerprint(), logprobs=body.logprobs is not None),
        )

    async def models(self, request: Request) -> Response:
        self._authenticate(request)
        listing = ModelList(data=[Model(id=self.model_name, created=self.created)])
        return JSONResponse(listing.model_dump())

    async def health(self, request: Request) -> Response:
        """200 while the engine answers (one Info call, which also notices an engine restart)."""
        await asyncio.to_thread(self.fleet.check_engine)
        return JSONResponse({"status": "ok"})

    # -- the generation ------------------------------------------------------------------------------
    async def _complete(
        self,
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        prompt: Prompt,
        call: CallContext,
        shape: Shape,
    ) -> Response:
        call, scope = self._scoped(call, body.cache_salt or "")
        request_ = convert.gateway_request(body, prompt, scope)
        generation = Choices(self.fleet, request_, body.n, convert.stop_strings(body), call)
        try:
            await until_disconnected(request, generation.start(), generation.close)
            if not body.stream:
                answers = await until_disconnected(request, generation.answers(), generation.close)
                return JSONResponse(shape.response(answers, generation.usage()).model_dump())
        except BaseException:
            generation.close()
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _events(generation, shape, include_usage), media_type="text/event-stream", headers=SSE_HEADERS
        )

    # -- checks --------------------------------------------------------------------------------------
    def _authenticate(self, request: Request) -> CallContext:
        """The caller: its owner and credential (forwarded to the engine); 401 without a valid token."""
        if self.auth is None:
            return CallContext(unauthenticated_owner())
        value = request.headers.get("authorization", "")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing 'Authorization: Bearer <token>' header", code="invalid_api_key")
        try:
            owner = self.auth.owner_for(check_token(token.strip(), "bearer token"))
        except InvalidArgument as exc:
            raise ApiError(401, f"malformed bearer token: {exc}", code="invalid_api_key") from None
        if owner is None:
            raise ApiError(401, "unknown bearer token", code="invalid_api_key")
        return CallContext(owner, value.strip())

    def _scoped(self, call: CallContext, cache_salt: str = "") -> tuple[CallContext, str]:
        """The caller's key scope, and the call with it (its texts' pieces are tokenized once per scope)."""
        scope = self.tenancy.scope(Tenant(call.owner, bool(call.credential)), self.namespace, cache_salt)
        return replace(call, cache_scope=scope), scope

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _fingerprint(self) -> str:
        return f"fp_{self.fleet.fingerprint[:16]}"


async def _parse(request: Request, model: type[Body]) -> Body:
    return model.model_validate_json(await request.body())  # ValidationError: a 400 naming the field


async def _events(generation: Choices, shape: Shape, include_usage: bool) -> AsyncIterator[str]:
    """The response stream. Starlette cancels it when the client disconnects; ``finally`` then ends
    the generation."""
    try:
        for index in range(len(generation.generations)):
            first = shape.first(index)
            if first is not None:
                yield event(first)
        async for index, piece in generation.stream():
            if isinstance(piece, str):  # the choice's finish reason
                yield event(shape.final(index, piece))
            elif (chunk := shape.delta(index, piece.text, piece.logprobs)) is not None:
                yield event(chunk)  # (None: held, with tools, until the choice's end)
        if include_usage:
            yield event(shape.usage_chunk(generation.usage()))
    except Exception as exc:  # noqa: BLE001 - status 200 is sent: the error travels as an event
        yield error_event(exc)
    finally:
        generation.close()
    yield DONE_EVENT
