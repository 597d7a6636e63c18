"""The bodies a Messages request answers with: the whole message, or Anthropic's event stream
(``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``, ``content_block_stop``,
``message_delta``, ``message_stop``). With tools offered the answer is held to its end (only the end
tells a call from text)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable

from prefix_service.http.generation import Generation
from prefix_service.http.messages_convert import MessagesUsage
from prefix_service.http.messages_errors import error_event
from prefix_service.http.tools import CALL_OPEN, ToolPlan


def sse(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"


def content_blocks(plan: ToolPlan, text: str) -> list[dict]:
    """The answer's blocks: its calls as ``tool_use`` (after any text before the first call), or text."""
    calls = plan.calls(text)
    if not calls:
        return [{"type": "text", "text": text}]
    lead = "" if plan.forced else text.split(CALL_OPEN, 1)[0].strip()
    blocks = [{"type": "text", "text": lead}] if lead else []
    for call in calls:
        tool_id = f"toolu_{call.id.removeprefix('call_')}"
        blocks.append(
            {"type": "tool_use", "id": tool_id, "name": call.name, "input": json.loads(call.arguments)}
        )
    return blocks


def stop_reason(generation: Generation, blocks: list[dict]) -> str:
    if any(b["type"] == "tool_use" for b in blocks):
        return "tool_use"
    if generation.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if generation.stop_sequence is not None else "end_turn"


class MessageShape:
    """One response's id and model; builds the whole message or its events."""

    def __init__(self, model: str, plan: ToolPlan, usage: Callable[[int], MessagesUsage]) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model, self.plan, self._usage = model, plan, usage

    def message(self, content: list[dict], reason: str | None, stop: str | None, output: int) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop,
            "usage": self._usage(output).body(),
        }

    async def whole(self, generation: Generation) -> dict:
        text = "".join([d.text async for d in generation.deltas()])
        blocks = content_blocks(self.plan, text)
        reason = stop_reason(generation, blocks)
        return self.message(blocks, reason, generation.stop_sequence, generation.completion_tokens)

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        """The event stream; a failure after the start is an ``error`` event; ``finally`` ends the
        generation (Starlette cancels the stream when the client disconnects)."""
        try:
            yield sse("message_start", {"message": self.message([], None, None, 0)})
            blocks: list[dict] = []
            if self.plan.active:
                yield sse("ping", {})
                text = "".join([d.text async for d in generation.deltas()])
                blocks = content_blocks(self.plan, text)
                for index, block in enumerate(blocks):
                    for event in _block_events(index, block):
                        yield event
            else:
                blocks = [{"type": "text", "text": ""}]
                yield sse("content_block_start", {"index": 0, "content_block": blocks[0]})
                yield sse("ping", {})
                async for delta in generation.deltas():
                    if delta.text:
                        yield sse(
                            "content_block_delta",
                            {"index": 0, "delta": {"type": "text_delta", "text": delta.text}},
                        )
                yield sse("content_block_stop", {"index": 0})
            usage = self._usage(generation.completion_tokens).body()
            delta = {
                "stop_reason": stop_reason(generation, blocks),
                "stop_sequence": generation.stop_sequence,
            }
            yield sse("message_delta", {"delta": delta, "usage": usage})
            yield sse("message_stop", {})
        except Exception as exc:  # noqa: BLE001 - status 200 is sent: the error travels as an event
            yield error_event(exc)
        finally:
            generation.close()


def _block_events(index: int, block: dict) -> list[str]:
    if block["type"] == "text":
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    else:
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
    return [
        sse("content_block_start", {"index": index, "content_block": start}),
        sse("content_block_delta", {"index": index, "delta": delta}),
        sse("content_block_stop", {"index": index}),
    ]
