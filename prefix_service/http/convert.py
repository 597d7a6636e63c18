"""OpenAI request bodies -> gateway requests, and gateway events -> usage. Pure functions. Where OpenAI's
API and forkline differ (defaults, refused fields, ``n``, ``response_format``, ``logprobs``): docs/HTTP.md."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence

from engine_service.api.config import GenConfig
from engine_service.api.prompts import TextPrompt
from engine_service.api.stream_events import Started
from prefix_service.gateway.calls import GatewayRequest, Prompt
from prefix_service.http.errors import BadField
from prefix_service.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)
from prefix_service.http.tools import ToolPlan, call_text, tool_plan, tool_response, tools_prompt

NAMESPACE = ""  # the prefix namespace of every HTTP request (``user`` is ignored, see above)
UNLIMITED_TOKENS = 1 << 30  # no max_tokens: the engine stops at end-of-sequence or a full session
MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n: each choice holds an engine session (and counts in its owner's quota)
JSON_OBJECT = '{"type": "object"}'  # response_format json_object: any JSON object
FINISH_REASONS = {"stop": "stop", "length": "length"}  # engine -> OpenAI; "cancelled" is an error


# -- chat -----------------------------------------------------------------------------------------


def chat_prompt(messages: Sequence[ChatMessage], plan: ToolPlan | None = None) -> TextPrompt:
    """The whole conversation as the engine's chat input (the engine renders it with the template),
    the offered tools appended to the first system message (or sent as one)."""
    turns = [(_role(m), _turn(m, i)) for i, m in enumerate(messages)]
    offer = tools_prompt(plan or ToolPlan())
    if offer and turns and turns[0][0] == "system":
        turns[0] = ("system", f"{turns[0][1]}\n\n{offer}")
    elif offer:
        turns.insert(0, ("system", offer))
    return TextPrompt("", chat=True, messages=tuple(turns))


def served(prompt: TextPrompt, chat_template: bool) -> TextPrompt:
    """``prompt`` as the door sends it: unchanged where the engines have a chat template; on a base
    model (none) a conversation is plain text, its messages' texts in order one paragraph each (joined
    by a blank line, empty ones skipped) after the tokenizer's special tokens -- the text a base model
    continues, as ``/v1/completions`` sends it. Spec: docs/HTTP.md#base-models."""
    if chat_template or not prompt.chat:
        return prompt
    texts = [content for _, content in prompt.conversation() if content]
    return TextPrompt("\n\n".join(texts), add_special_tokens=True)


def _role(message: ChatMessage) -> str:
    if message.role == "tool":
        return "user"  # a tool's answer is a user turn wrapped in <tool_response> (tools.py)
    return "system" if message.role == "developer" else message.role


def _turn(message: ChatMessage, index: int) -> str:
    text = _content(message, index)
    if message.role == "tool":
        return tool_response(text, message.tool_call_id)
    if message.tool_calls:
        return text + call_text(message.tool_calls, index)
    return text


def _content(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise BadField(
                f"messages[{index}].content[{j}]", f"only text parts are supported, got {part.type!r}"
            )
        texts.append(part.text)
    return "\n".join(texts)


def check_chat(request: ChatCompletionRequest) -> None:
    """Refuse what a chat request asks for and forkline cannot do (naming the field)."""
    _check_common(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise BadField("top_logprobs", "needs logprobs: true")
    if chat_tools(request).forced and response_schema(request.response_format):
        raise BadField("response_format", "a forced tool call's output is the call: no response_format")
    response_schema(request.response_format)


def chat_tools(request: ChatCompletionRequest) -> ToolPlan:
    """What the request's ``tools`` / ``tool_choice`` ask (``tools.py``)."""
    return tool_plan(request.tools, request.tool_choice)


def response_schema(response_format: dict | None) -> str:
    """The engine's ``json_schema`` for a chat request's ``response_format`` ("" for text)."""
    if not response_format:
        return ""
    kind = response_format.get("type", "text")
    if kind == "text":
        return ""
    if kind == "json_object":
        return JSON_OBJECT
    if kind != "json_schema":
        raise BadField("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise BadField("response_format.json_schema", "must be an object with a name and a schema")
    if not isinstance(spec.get("strict", False), bool):
        raise BadField("response_format.json_schema.strict", "must be a boolean")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise BadField("response_format.json_schema.schema", "must be a JSON Schema object")
    return json.dumps(schema)


def top_logprobs(request: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many alternatives per token the request asks for (None: no log probabilities)."""
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


# -- completions ----------------------------------------------------------------------------------


def completion_prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> Prompt:
    """One prompt: text (tokenized with special tokens) or token ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadField("prompt", f"one prompt per request is supported, got {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return TextPrompt(prompt, add_special_tokens=True)
    return list(prompt)


def check_completion(request: CompletionRequest) -> None:
    _check_common(request)
    if request.echo:
        raise BadField("echo", "echoing the prompt is not supported")
    if request.best_of not in (None, 1):
        raise BadField("best_of", "only best_of=1 is supported")
    if request.suffix:
        raise BadField("suffix", "suffixes (insertion) are not supported")


# -- both -----------------------------------------------------------------------------------------


def _check_common(request: ChatCompletionRequest | CompletionRequest) -> None:
    if request.n > MAX_CHOICES:
        raise BadField("n", f"at most {MAX_CHOICES} choices per request, got {request.n}")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name):
            raise BadField(name, "penalties are not supported (0 only)")
    if request.logit_bias:
        raise BadField("logit_bias", "logit biases are not supported")
    stop_strings(request)


def stop_strings(request: ChatCompletionRequest | CompletionRequest) -> tuple[str, ...]:
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise BadField("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for i, s in enumerate(stops):
        if not s:
            raise BadField("stop" if isinstance(request.stop, str) else f"stop[{i}]", "must not be empty")
    return tuple(stops)


def gateway_request(
    request: ChatCompletionRequest | CompletionRequest, prompt: Prompt, namespace: str = NAMESPACE
) -> GatewayRequest:
    """The gateway call for a checked request in ``namespace`` (the caller's scope)."""
    max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens
    config = GenConfig(
        max_new_tokens=max_tokens or UNLIMITED_TOKENS,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        seed=secrets.randbelow(2**63) if request.seed is None else request.seed,
        top_logprobs=top_logprobs(request),
        json_schema=_schema(request),
        speculative=request.speculative or "",
    )
    return GatewayRequest(namespace=namespace, prompt=prompt, config=config)


def _schema(request: ChatCompletionRequest | CompletionRequest) -> str:
    """The engine's json_schema: a forced tool call's, or the response_format's."""
    if not isinstance(request, ChatCompletionRequest):
        return ""
    return chat_tools(request).schema or response_schema(request.response_format)


def usage(started: Started, completion_tokens: int) -> Usage:
    """Usage of a generation that ``started`` so: the prompt is what the session reused plus what the
    engine prefilled; ``cached_tokens`` is the reused part."""
    prompt_tokens = started.position + started.input_positions
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=started.position),
    )
