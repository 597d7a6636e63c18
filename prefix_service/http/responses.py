"""The bodies one chat or text completion answers with -- the whole response, or its stream's chunks in
OpenAI's order per choice -- made by a per-request :class:`ChatShape` / :class:`CompletionShape`."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from engine_service.api.logprobs import TokenLogprob
from prefix_service.http import tools
from prefix_service.http.logprob_shapes import chat_logprobs, completion_logprobs
from prefix_service.http.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    FunctionCall,
    ToolCall,
    ToolCallDelta,
    Usage,
)

DONE_EVENT = "data: [DONE]\n\n"
_NO_TOOLS = tools.ToolPlan()


def event(body: BaseModel) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {body.model_dump_json()}\n\n"


@dataclass(frozen=True)
class Answer:
    """One finished choice: its text, why it ended, the log probabilities of its tokens."""

    index: int
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] = ()


class Shape(Protocol):
    def first(self, index: int) -> BaseModel | None: ...

    def delta(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...]) -> BaseModel | None: ...

    def final(self, index: int, finish_reason: str) -> BaseModel: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    def response(self, answers: list[Answer], usage: Usage) -> BaseModel: ...


class _Ids:
    def __init__(self, prefix: str, model: str, fingerprint: str, logprobs: bool) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint or None
        self.logprobs = logprobs  # whether the request asked for log probabilities

    def common(self) -> dict:
        return {
            "id": self.id,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }


class ChatShape(_Ids):
    def __init__(
        self, model: str, fingerprint: str, logprobs: bool = False, tools: tools.ToolPlan | None = None
    ) -> None:
        super().__init__("chatcmpl", model, fingerprint, logprobs)
        self.tools = tools or _NO_TOOLS
        self._held: dict[int, tuple[str, tuple[TokenLogprob, ...]]] = {}  # with tools: each choice so far

    def first(self, index: int) -> ChatCompletionChunk:
        return self._chunk(index, ChatDelta(role="assistant", content=""))

    def delta(
        self, index: int, text: str, logprobs: tuple[TokenLogprob, ...] = ()
    ) -> ChatCompletionChunk | None:
        if self.tools.active:
            held, lp = self._held.get(index, ("", ()))
            self._held[index] = (held + text, lp + logprobs)
            return None
        return self._chunk(index, ChatDelta(content=text), logprobs=logprobs)

    def final(self, index: int, finish_reason: str) -> ChatCompletionChunk:
        if not self.tools.active:
            return self._chunk(index, ChatDelta(), finish_reason)
        text, logprobs = self._held.pop(index, ("", ()))
        calls = self.tools.calls(text)
        if not calls:
            return self._chunk(index, ChatDelta(content=text), finish_reason, logprobs)
        deltas = [ToolCallDelta(index=j, **_call(c).model_dump()) for j, c in enumerate(calls)]
        return self._chunk(index, ChatDelta(tool_calls=deltas), "tool_calls", logprobs)

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.common(), choices=[], usage=usage)

    def response(self, answers: list[Answer], usage: Usage) -> ChatCompletion:
        choices = []
        for a in answers:
            calls = self.tools.calls(a.text)
            message = AssistantMessage(content=None, tool_calls=[_call(c) for c in calls]) if calls else None
            choices.append(
                ChatChoice(
                    index=a.index,
                    message=message or AssistantMessage(content=a.text),
                    finish_reason="tool_calls" if calls else a.finish_reason,
                    logprobs=chat_logprobs(a.logprobs) if self.logprobs else None,
                )
            )
        return ChatCompletion(**self.common(), choices=choices, usage=usage)

    def _chunk(
        self,
        index: int,
        delta: ChatDelta,
        finish_reason: str | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            finish_reason=finish_reason,
            logprobs=chat_logprobs(logprobs) if self.logprobs and logprobs else None,
        )
        return ChatCompletionChunk(**self.common(), choices=[choice])


def _call(call: tools.ToolCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


class CompletionShape(_Ids):
    def __init__(self, model: str, fingerprint: str, logprobs: bool = False) -> None:
        super().__init__("cmpl", model, fingerprint, logprobs)
        self._offsets: dict[int, int] = {}  # per choice: where the next chunk's text starts

    def first(self, index: int) -> None:
        return None

    def delta(self, index: int, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> Completion:
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(text)
        lp = completion_logprobs(logprobs, offset) if self.logprobs and logprobs else None
        return Completion(**self.common(), choices=[CompletionChoice(index=index, text=text, logprobs=lp)])

    def final(self, index: int, finish_reason: str) -> Completion:
        choice = CompletionChoice(index=index, text="", finish_reason=finish_reason)
        return Completion(**self.common(), choices=[choice])

    def usage_chunk(self, usage: Usage) -> Completion:
        return Completion(**self.common(), choices=[], usage=usage)

    def response(self, answers: list[Answer], usage: Usage) -> Completion:
        choices = [
            CompletionChoice(
                index=a.index,
                text=a.text,
                finish_reason=a.finish_reason,
                logprobs=completion_logprobs(a.logprobs) if self.logprobs else None,
            )
            for a in answers
        ]
        return Completion(**self.common(), choices=choices, usage=usage)
