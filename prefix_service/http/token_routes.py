"""``POST /tokenize`` and ``POST /detokenize`` in the shapes llama-server and vLLM both use: either
server's request is accepted and the answer carries both servers' keys. Spec: docs/HTTP.md#tokenize-and-detokenize."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine_service.api.call_context import CallContext
from engine_service.api.errors import InvalidArgument
from engine_service.api.prompts import TextPrompt
from prefix_service.http import convert
from prefix_service.http.errors import BadField, answering_errors
from prefix_service.http.protocol import ChatMessage, TokenId


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TokenizeRequest(_Strict):
    """One of ``content`` (llama-server), ``prompt`` or ``messages`` (vLLM)."""

    content: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special: bool | None = None  # llama-server's name (default false)
    add_special_tokens: bool | None = None  # vLLM's name (default true for a prompt)
    add_generation_prompt: bool | None = None  # vLLM chat: true only (the engine renders with it)
    with_pieces: bool = False  # llama-server: tokens as {"id", "piece"}
    return_token_strs: bool = False  # vLLM: the pieces as "token_strs"
    model: str | None = None


class DetokenizeRequest(_Strict):
    tokens: list[TokenId]
    model: str | None = None


def routes(door: Any) -> list[Route]:
    """The routes over ``door`` (app.py's _Door); errors answer in OpenAI's shape."""
    api = _TokenRoutes(door)
    return [
        Route("/tokenize", answering_errors(api.tokenize), methods=["POST"]),
        Route("/detokenize", answering_errors(api.detokenize), methods=["POST"]),
    ]


class _TokenRoutes:
    def __init__(self, door: Any) -> None:
        self.door = door

    async def tokenize(self, request: Request) -> Response:
        call = self.door._authenticate(request)
        body = TokenizeRequest.model_validate_json(await request.body())
        if body.model is not None:
            self.door._check_model(body.model)
        call = self.door._scoped(call)[0]
        prompt = _prompt(body)
        fleet = self.door.fleet

        def answer() -> dict:
            ids = list(fleet.tokenize(prompt, call).ids)
            out: dict = {"tokens": ids, "count": len(ids), "max_model_len": _max_model_len(fleet)}
            if body.with_pieces or body.return_token_strs:
                pieces = _pieces(fleet, ids, call)
                if body.with_pieces:
                    out["tokens"] = [{"id": i, "piece": p} for i, p in zip(ids, pieces, strict=True)]
                if body.return_token_strs:
                    out["token_strs"] = pieces
            return out

        return JSONResponse(await asyncio.to_thread(answer))

    async def detokenize(self, request: Request) -> Response:
        call = self.door._authenticate(request)
        body = DetokenizeRequest.model_validate_json(await request.body())
        if body.model is not None:
            self.door._check_model(body.model)
        try:
            text = await asyncio.to_thread(self.door.fleet.detokenize, body.tokens, call)
        except InvalidArgument as exc:  # an id outside the vocabulary
            raise BadField("tokens", str(exc)) from None
        return JSONResponse({"content": text, "prompt": text})


def _prompt(body: TokenizeRequest) -> TextPrompt:
    given = [name for name in ("content", "prompt", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise BadField("content", f"send exactly one of content, prompt or messages (got {given or 'none'})")
    if (
        None not in (body.add_special, body.add_special_tokens)
        and body.add_special != body.add_special_tokens
    ):
        raise BadField("add_special_tokens", "contradicts add_special")
    special = body.add_special if body.add_special is not None else body.add_special_tokens
    if body.messages is not None:
        if special:
            raise BadField("add_special_tokens", "a chat prompt is rendered by the template (false only)")
        if body.add_generation_prompt is False:
            raise BadField(
                "add_generation_prompt", "the engine renders chats with the generation prompt (true only)"
            )
        return convert.chat_prompt(body.messages)
    if body.add_generation_prompt is not None:
        raise BadField("add_generation_prompt", "only with messages")
    if body.content is not None:
        return TextPrompt(body.content, add_special_tokens=bool(special))
    return TextPrompt(body.prompt or "", add_special_tokens=special is not False)


def _max_model_len(fleet: Any) -> int:
    """The longest session every engine serves (positions)."""
    return min((m.gateway.engine.max_session_tokens for m in fleet.members()), default=0)


def _pieces(fleet: Any, ids: list[int], call: CallContext) -> list[str]:
    """Each token's text alone (one Detokenize per distinct id; U+FFFD where a token is a partial
    UTF-8 sequence)."""
    text = {i: fleet.detokenize([i], call) for i in set(ids)}
    return [text[i] for i in ids]
