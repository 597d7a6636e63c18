"""OpenAI's Responses API on the HTTP door: ``POST /v1/responses`` (whole or streamed), ``GET`` /
``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``; stored responses per owner
(``response_store.py``), ``previous_response_id`` continued exactly (``responses_prompt.py``).
Spec: docs/HTTP.md#v1responses."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prefix_service.gateway.calls import GatewayRequest
from prefix_service.http.disconnect import until_disconnected
from prefix_service.http.errors import ApiError, BadField, answering_errors
from prefix_service.http.generation import Generation
from prefix_service.http.response_store import ResponseStore, StoredResponse
from prefix_service.http.responses_convert import (
    check_request,
    gen_config,
    head_turns,
    input_items,
    item_turns,
    response_tools,
)
from prefix_service.http.responses_prompt import prompt_ids
from prefix_service.http.responses_protocol import DeletedResponse, ItemList, ResponseRequest
from prefix_service.http.responses_stream import ResponseRun, events

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_LIST = 100  # input_items: at most this many per page (OpenAI's limit)


def routes(door: Any, store: ResponseStore | None = None) -> list[Route]:
    """The routes over ``door`` (app.py's _Door); errors answer in OpenAI's shape."""
    api = _Responses(door, store or ResponseStore())
    return [
        Route("/v1/responses", answering_errors(api.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", answering_errors(api.retrieve), methods=["GET"]),
        Route("/v1/responses/{response_id}", answering_errors(api.delete), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", answering_errors(api.input_items), methods=["GET"]),
    ]


class _Responses:
    def __init__(self, door: Any, store: ResponseStore) -> None:
        self.door, self.store = door, store

    async def create(self, request: Request) -> Response:
        call = self.door._authenticate(request)
        body = ResponseRequest.model_validate_json(await request.body())  # ValidationError: a 400
        self.door._check_model(body.model)
        check_request(body)
        call, owner = self.door._scoped(call, body.cache_salt or "")
        previous = None
        if body.previous_response_id is not None:
            previous = self._stored(owner, body.previous_response_id, "previous_response_id")
        plan = response_tools(body)
        inputs = input_items(body.input)
        conversation = (*(previous.conversation if previous else ()), *inputs)
        turns = (*head_turns(body.instructions, plan), *item_turns(conversation))
        if not turns:
            raise BadField("input", "must not be empty")
        fleet = self.door.fleet
        ids = await asyncio.to_thread(prompt_ids, fleet, call, turns, previous)
        gateway_request = GatewayRequest(
            namespace=owner,
            prompt=list(ids.ids),
            config=gen_config(body, plan),
            message_ends=ids.message_ends,
        )
        run = ResponseRun.new(
            request=body,
            plan=plan,
            model=self.door.model_name,
            inputs=inputs,
            conversation=conversation,
            turns=turns,
            prompt=ids,
            owner=owner,
            store=self.store,
        )
        generation = Generation(fleet, gateway_request, (), call)
        try:
            await until_disconnected(request, generation.start(), generation.close)
            if not body.stream:
                text = await until_disconnected(request, _text(generation), generation.close)
                return JSONResponse(run.finish(text, generation).model_dump())
        except BaseException:
            generation.close()
            raise
        return StreamingResponse(events(run, generation), media_type="text/event-stream", headers=SSE_HEADERS)

    async def retrieve(self, request: Request) -> Response:
        stored = self._find(request)
        return JSONResponse(stored.body)

    async def delete(self, request: Request) -> Response:
        stored = self._find(request)
        self.store.delete(self._owner_of(request), stored.id)
        return JSONResponse(DeletedResponse(id=stored.id).model_dump())

    async def input_items(self, request: Request) -> Response:
        stored = self._find(request)
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadField("order", f"must be asc or desc, got {order!r}")
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            raise BadField("limit", "must be an integer") from None
        if not 1 <= limit <= MAX_LIST:
            raise BadField("limit", f"must be 1-{MAX_LIST}, got {limit}")
        items = list(stored.input_items if order == "asc" else reversed(stored.input_items))
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise BadField("after", f"no input item {after!r} in this response")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        listing = ItemList(
            data=page,
            first_id=page[0]["id"] if page else None,
            last_id=page[-1]["id"] if page else None,
            has_more=len(items) > limit,
        )
        return JSONResponse(listing.model_dump())

    # -- owners ----------------------------------------------------------------------------------
    def _owner_of(self, request: Request) -> str:
        """The owner of a GET / DELETE: the caller's cache scope (the store's owner and the namespace its
        generations use), with the ``cache_salt`` query parameter if any."""
        salt = request.query_params.get("cache_salt", "")
        if len(salt) > 1024:
            raise BadField("cache_salt", "at most 1024 characters")
        return self.door._scoped(self.door._authenticate(request), salt)[1]

    def _find(self, request: Request) -> StoredResponse:
        owner = self._owner_of(request)
        return self._stored(owner, request.path_params["response_id"], "response_id")

    def _stored(self, owner: str, response_id: str, param: str) -> StoredResponse:
        """The owner's stored response; another owner's is missing alike (404)."""
        stored = self.store.get(owner, response_id)
        if stored is None:
            raise ApiError(404, f"Response with id {response_id!r} not found.", param=param)
        return stored


async def _text(generation: Generation) -> str:
    return "".join([delta.text async for delta in generation.deltas()])
