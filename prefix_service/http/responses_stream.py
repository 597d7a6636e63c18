"""One ``/v1/responses`` generation as it ends (:class:`ResponseRun`: the response object, stored when
``store``) and as its event stream, in the documented order: ``response.created``,
``response.in_progress``, per output item ``output_item.added`` .. ``output_item.done`` (text: content
part and ``output_text`` deltas; calls: ``function_call_arguments``), then ``response.completed`` (or
``response.incomplete``); every event with its ``type`` and ``sequence_number``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prefix_service.http.errors import error_body
from prefix_service.http.generation import Generation
from prefix_service.http.response_store import ResponseStore, StoredResponse, packed
from prefix_service.http.responses_convert import Turn, new_id, output_items, response_usage
from prefix_service.http.responses_prompt import PromptIds
from prefix_service.http.responses_protocol import (
    IncompleteDetails,
    MessageItem,
    OutputText,
    ResponseObject,
    ResponseRequest,
)
from prefix_service.http.tools import ToolPlan


@dataclass(frozen=True)
class ResponseRun:
    """What one response needs to answer and be stored: the request, its tool plan, its new input
    items, the whole conversation before its answer, the turns rendered and the ids run."""

    request: ResponseRequest
    plan: ToolPlan
    model: str
    inputs: tuple[dict, ...]
    conversation: tuple[dict, ...]
    turns: tuple[Turn, ...]
    prompt: PromptIds
    owner: str
    store: ResponseStore
    id: str
    created_at: int
    message_id: str

    @classmethod
    def new(cls, **fields) -> ResponseRun:
        return cls(**fields, id=new_id("resp"), created_at=int(time.time()), message_id=new_id("msg"))

    def draft(self, status: str = "in_progress") -> ResponseObject:
        r = self.request
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,
            instructions=r.instructions,
            max_output_tokens=r.max_output_tokens,
            model=self.model,
            parallel_tool_calls=r.parallel_tool_calls is not False,
            previous_response_id=r.previous_response_id,
            store=r.store,
            temperature=1.0 if r.temperature is None else r.temperature,
            text={"format": (r.text.format if r.text else None) or {"type": "text"}},
            tool_choice=r.tool_choice if r.tool_choice is not None else ("auto" if r.tools else "none"),
            tools=list(r.tools or ()),
            top_p=1.0 if r.top_p is None else r.top_p,
            user=r.user,
            metadata=dict(r.metadata or {}),
        )

    def finish(self, text: str, generation: Generation) -> ResponseObject:
        """The finished response (stored when the request asked): its output items and usage."""
        cut = generation.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        output = output_items(
            text, self.plan, self.request.parallel_tool_calls is not False, status, self.message_id
        )
        response = self.draft(status).model_copy(
            update={
                "output": output,
                "usage": response_usage(generation.started, generation.completion_tokens),
                "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
            }
        )
        if self.request.store:
            body = response.model_dump()
            stored = StoredResponse(
                id=self.id,
                body=body,
                input_items=self.inputs,
                conversation=(*self.conversation, *body["output"]),
                turns=self.turns,
                prompt_bytes=packed(self.prompt.ids),
                generated_bytes=packed(generation.ids),
                stopped=generation.finish_reason == "stop",
            )
            self.store.put(self.owner, stored)
        return response


class _Events:
    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"


async def events(run: ResponseRun, generation: Generation) -> AsyncIterator[str]:
    """The response's event stream; ``generation`` started. An error after the start travels as an
    ``error`` event; ``finally`` ends the generation (a client that left)."""
    send = _Events()
    try:
        draft = run.draft().model_dump()
        yield send("response.created", response=draft)
        yield send("response.in_progress", response=draft)
        texts: list[str] = []
        if run.plan.active:  # only the end tells a call from an answer: held until then
            async for delta in generation.deltas():
                texts.append(delta.text)
            response = run.finish("".join(texts), generation)
            for index, item in enumerate(response.output):
                for chunk in _item_events(send, index, item.model_dump()):
                    yield chunk
        else:
            where = {"item_id": run.message_id, "output_index": 0}
            opened = MessageItem(id=run.message_id, status="in_progress", content=[]).model_dump()
            yield send("response.output_item.added", output_index=0, item=opened)
            part = OutputText(text="").model_dump()
            yield send("response.content_part.added", **where, content_index=0, part=part)
            async for delta in generation.deltas():
                texts.append(delta.text)
                yield send(
                    "response.output_text.delta", **where, content_index=0, delta=delta.text, logprobs=[]
                )
            response = run.finish("".join(texts), generation)
            item = response.output[0].model_dump()
            yield send(
                "response.output_text.done",
                **where,
                content_index=0,
                text=item["content"][0]["text"],
                logprobs=[],
            )
            yield send("response.content_part.done", **where, content_index=0, part=item["content"][0])
            yield send("response.output_item.done", output_index=0, item=item)
        final = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield send(final, response=response.model_dump())
    except Exception as exc:  # noqa: BLE001 - status 200 is sent: the error travels as an event
        status, body = error_body(exc)
        detail = body.error
        yield send("error", code=detail.code or str(status), message=detail.message, param=detail.param)
    finally:
        generation.close()


def _item_events(send: _Events, index: int, item: dict) -> list[str]:
    """The events of one finished output item, its text or arguments as one delta."""
    opened = {**item, "status": "in_progress"}
    if item["type"] == "function_call":
        where = {"item_id": item["id"], "output_index": index}
        return [
            send("response.output_item.added", output_index=index, item={**opened, "arguments": ""}),
            send("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            send("response.function_call_arguments.done", **where, arguments=item["arguments"]),
            send("response.output_item.done", output_index=index, item=item),
        ]
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    part, text = item["content"][0], item["content"][0]["text"]
    return [
        send("response.output_item.added", output_index=index, item={**opened, "content": []}),
        send("response.content_part.added", **where, part={**part, "text": ""}),
        send("response.output_text.delta", **where, delta=text, logprobs=[]),
        send("response.output_text.done", **where, text=text, logprobs=[]),
        send("response.content_part.done", **where, part=part),
        send("response.output_item.done", output_index=index, item=item),
    ]
