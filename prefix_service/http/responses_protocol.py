"""OpenAI's Responses API bodies (``/v1/responses``) as pydantic models. The request is strict and
closed: a field the API has that forkline does not implement is accepted only at its neutral value
(``responses_convert.check_request``), any other unknown field is a 400 naming it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prefix_service.http.protocol import MAX_INT32


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- the request ----------------------------------------------------------------------------------


class TextConfig(_Closed):
    format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: Literal["medium"] | None = None  # the only one forkline has


class ResponseRequest(_Closed):
    model: str
    input: str | list[dict] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)  # forkline's extension
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    user: str | None = None  # accepted, ignored
    safety_identifier: str | None = None  # accepted, ignored
    prompt_cache_key: str | None = None  # accepted, ignored: the cache keys by the tokens themselves
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: dict | None = None  # include_obfuscation: accepted, nothing is obfuscated
    cache_salt: str | None = Field(default=None, max_length=1024)  # vLLM's: partitions cache and store
    # The API's fields forkline does not implement: refused unless neutral (responses_convert.py).
    background: Any = None
    include: Any = None
    reasoning: Any = None
    truncation: Any = None
    conversation: Any = None
    prompt: Any = None
    service_tier: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None


# -- the response ---------------------------------------------------------------------------------


class InputTokensDetails(_Out):
    cached_tokens: int


class OutputTokensDetails(_Out):
    reasoning_tokens: int = 0


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class OutputText(_Out):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class MessageItem(_Out):
    id: str
    type: Literal["message"] = "message"
    status: str = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(_Out):
    id: str
    type: Literal["function_call"] = "function_call"
    status: str = "completed"
    call_id: str
    name: str
    arguments: str


OutputItem = MessageItem | FunctionCallItem


class Reasoning(_Out):
    effort: None = None
    summary: None = None


class IncompleteDetails(_Out):
    reason: str


class ResponseObject(_Out):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool = False
    error: dict | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: Reasoning = Reasoning()
    store: bool = True
    temperature: float = 1.0
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict = "auto"
    tools: list[dict] = Field(default_factory=list)
    top_p: float = 1.0
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(_Out):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class ItemList(_Out):
    object: Literal["list"] = "list"
    data: list[dict]
    first_id: str | None
    last_id: str | None
    has_more: bool
