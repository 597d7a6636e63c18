"""The bodies one chat or text completion answers with: the whole response, or its stream's chunks.

A :class:`ChatShape` / :class:`CompletionShape` is made per request (its id and creation time) and
turns text, finish reasons and usage into the protocol models; the handlers stay shape-agnostic.
Streams follow OpenAI's order: (chat) a first chunk with the assistant role, content chunks, a chunk
with the finish reason, then -- with ``stream_options.include_usage`` -- a chunk with empty choices
and the usage, then ``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from typing import Protocol

from pydantic import BaseModel

from prefix_service.http.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    Usage,
)

DONE_EVENT = "data: [DONE]\n\n"


def event(body: BaseModel) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {body.model_dump_json()}\n\n"


class Shape(Protocol):
    def first(self) -> BaseModel | None: ...

    def delta(self, text: str) -> BaseModel: ...

    def final(self, finish_reason: str) -> BaseModel: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    def response(self, text: str, finish_reason: str, usage: Usage) -> BaseModel: ...


class _Ids:
    def __init__(self, prefix: str, model: str, fingerprint: str) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint or None

    def common(self) -> dict:
        return {
            "id": self.id,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }


class ChatShape(_Ids):
    def __init__(self, model: str, fingerprint: str) -> None:
        super().__init__("chatcmpl", model, fingerprint)

    def first(self) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(role="assistant", content=""))

    def delta(self, text: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(content=text))

    def final(self, finish_reason: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(), finish_reason)

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.common(), choices=[], usage=usage)

    def response(self, text: str, finish_reason: str, usage: Usage) -> ChatCompletion:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return ChatCompletion(**self.common(), choices=[choice], usage=usage)

    def _chunk(self, delta: ChatDelta, finish_reason: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            **self.common(), choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)]
        )


class CompletionShape(_Ids):
    def __init__(self, model: str, fingerprint: str) -> None:
        super().__init__("cmpl", model, fingerprint)

    def first(self) -> None:
        return None

    def delta(self, text: str) -> Completion:
        return Completion(**self.common(), choices=[CompletionChoice(text=text)])

    def final(self, finish_reason: str) -> Completion:
        return Completion(**self.common(), choices=[CompletionChoice(text="", finish_reason=finish_reason)])

    def usage_chunk(self, usage: Usage) -> Completion:
        return Completion(**self.common(), choices=[], usage=usage)

    def response(self, text: str, finish_reason: str, usage: Usage) -> Completion:
        return Completion(
            **self.common(), choices=[CompletionChoice(text=text, finish_reason=finish_reason)], usage=usage
        )
