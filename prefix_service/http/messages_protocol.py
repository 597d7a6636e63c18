"""Anthropic's Messages API request bodies as pydantic models: validated strictly, and every field
forkline does not serve (``thinking``, ``container``, image blocks, ...) refused naming it. Spec:
docs/HTTP.md#anthropics-messages-api."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prefix_service.http.protocol import MAX_INT32

MAX_BREAKPOINTS = 4  # blocks with cache_control per request, as Anthropic


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class CacheControl(_Strict):
    """``{"type": "ephemeral", "ttl"?}``: the block's end is a prefill breakpoint (the ttl is accepted;
    the prefix cache's retention policy decides how long a snapshot stays)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(max_length=256)
    name: str = Field(max_length=256)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(max_length=256)
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]
BLOCK_TYPES = ("text", "tool_use", "tool_result")


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Strict):
    """A client tool; server tools (another ``type``) are refused naming ``tools[i].type``."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str = ""
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # accepted: an answer holds at most one forced call


class Metadata(_Strict):
    user_id: str | None = Field(default=None, max_length=256)  # accepted, ignored


class CountTokensRequest(_Strict):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None  # top level: marks the last block of the last message


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1, le=MAX_INT32)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=MAX_INT32)
    metadata: Metadata | None = None
