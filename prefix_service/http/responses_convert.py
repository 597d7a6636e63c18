"""Responses API requests -> the chat machinery (``tools.py``, the chat template's turns, the engine's
config), and answers -> output items. Pure functions; a bad field is a 400 naming it (``BadField``).
Spec: docs/HTTP.md#v1responses."""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Sequence

from engine_service.api.config import GenConfig
from engine_service.api.stream_events import Started
from prefix_service.http.convert import JSON_OBJECT, UNLIMITED_TOKENS
from prefix_service.http.errors import BadField
from prefix_service.http.responses_protocol import (
    FunctionCallItem,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    ResponseRequest,
    ResponseUsage,
)
from prefix_service.http.tools import ToolPlan, call_text, tool_plan, tool_response, tools_prompt

Turn = tuple[str, str]  # (role, content) as the chat template renders it

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_NEUTRAL = {  # the API's fields forkline does not implement, and the values that ask nothing of it
    "background": (None, False),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "conversation": (None,),
    "prompt": (None,),
    "service_tier": (None, "auto", "default"),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def check_request(request: ResponseRequest) -> None:
    """Refuse what the request asks and forkline cannot do, naming the field."""
    for name, neutral in _NEUTRAL.items():
        value = getattr(request, name)
        if not any(value == n and type(value) is type(n) for n in neutral):
            raise BadField(name, f"not supported by forkline (accepted: {_spelled(neutral)})")
    reasoning = request.reasoning
    if reasoning is not None and not (
        isinstance(reasoning, dict) and all(v is None for v in reasoning.values())
    ):
        raise BadField("reasoning", "not supported by forkline: the model has no reasoning settings")
    for key in request.metadata or {}:
        if len(key) > 64:
            raise BadField("metadata", "keys are at most 64 characters")
    options = request.stream_options
    if options is not None:
        if not request.stream:
            raise BadField("stream_options", "only with stream: true")
        if set(options) - {"include_obfuscation"} or not isinstance(
            options.get("include_obfuscation", False), bool
        ):
            raise BadField("stream_options", "only include_obfuscation (a boolean) is accepted")
    response_tools(request)
    text_schema(request)  # checked even where a forced call (whose output is the call) overrides it


def _spelled(values: tuple) -> str:
    return ", ".join(json.dumps(v) for v in values)


# -- input items ----------------------------------------------------------------------------------


def input_items(value: str | list[dict]) -> tuple[dict, ...]:
    """The request's ``input`` as checked items (a string: one user message), each with an ``id``."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    return tuple(_item(item, i) for i, item in enumerate(value))


def _item(item: dict, index: int) -> dict:
    where = f"input[{index}]"
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise BadField(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
        parts = _parts(item.get("content"), where, "output_text" if role == "assistant" else "input_text")
        prefix = "msg"
        out = {"type": "message", "role": role, "status": "completed", "content": parts}
    elif kind == "function_call":
        name, arguments = _text(item, "name", where), _text(item, "arguments", where)
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise BadField(f"{where}.arguments", "must be the JSON text of an object")
        prefix = "fc"
        out = {"type": kind, "status": "completed", "call_id": _text(item, "call_id", where)}
        out |= {"name": name, "arguments": arguments}
    elif kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            output = "\n".join(p["text"] for p in _parts(output, f"{where}.output", "input_text"))
        elif not isinstance(output, str):
            raise BadField(f"{where}.output", "must be a string or text parts")
        prefix = "fco"
        out = {
            "type": kind,
            "status": "completed",
            "call_id": _text(item, "call_id", where),
            "output": output,
        }
    else:
        raise BadField(
            f"{where}.type",
            f"{kind!r} items are not supported (message, function_call, function_call_output)",
        )
    item_id = item.get("id")
    if item_id is not None and not isinstance(item_id, str):
        raise BadField(f"{where}.id", "must be a string")
    return {"id": item_id or new_id(prefix), **out}


def _text(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadField(f"{where}.{key}", "is required (a string)")
    return value


def _parts(content: object, where: str, kind: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": kind, "text": content}]
    if not isinstance(content, list):
        raise BadField(f"{where}.content", "must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            got = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadField(
                f"{where}.content[{j}]", f"only input_text / output_text parts are supported, got {got!r}"
            )
        if not isinstance(part.get("text"), str):
            raise BadField(f"{where}.content[{j}].text", "is required (a string)")
        parts.append({"type": part["type"], "text": part["text"]})
    return parts


def item_turns(items: Sequence[dict]) -> list[Turn]:
    """Items as chat turns: system / developer messages are system turns; an assistant message and the
    function calls right after it are one assistant turn (``tools.call_text``), a call's output a
    user turn (``tools.tool_response``) -- as chat completions renders them."""
    turns: list[Turn] = []
    open_assistant = False  # the last turn is an assistant's that calls may extend
    for item in items:
        if item["type"] == "message":
            role = "system" if item["role"] in ("system", "developer") else item["role"]
            turns.append((role, "\n".join(p["text"] for p in item["content"])))
            open_assistant = role == "assistant"
        elif item["type"] == "function_call":
            call = call_text([{"function": {"name": item["name"], "arguments": item["arguments"]}}], 0)
            if open_assistant:
                turns[-1] = ("assistant", turns[-1][1] + call)
            else:
                turns.append(("assistant", call))
            open_assistant = True
        else:
            turns.append(("user", tool_response(item["output"], item["call_id"])))
            open_assistant = False
    return turns


def head_turns(instructions: str | None, plan: ToolPlan) -> list[Turn]:
    """The system turn of ``instructions`` and the offered tools (none without either)."""
    system = "\n\n".join(text for text in (instructions, tools_prompt(plan)) if text)
    return [("system", system)] if system else []


# -- tools, text.format, config -------------------------------------------------------------------


def response_tools(request: ResponseRequest) -> ToolPlan:
    """The Responses API's flat function tools and ``tool_choice`` as a chat :class:`ToolPlan`."""
    chat = []
    for i, tool in enumerate(request.tools or ()):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise BadField(
                f"tools[{i}].type", f"{kind!r}: only function tools are supported (no built-in tools)"
            )
        unknown = sorted(set(tool) - _TOOL_KEYS)
        if unknown:
            raise BadField(f"tools[{i}].{unknown[0]}", "unknown field of a function tool")
        if not isinstance(tool.get("strict", True), (bool, type(None))):
            raise BadField(f"tools[{i}].strict", "must be a boolean")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        chat.append({"type": "function", "function": function})
    choice = request.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) - {"type", "name"}:
            raise BadField("tool_choice", "must be none, auto, required or {'type': 'function', 'name': ...}")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    try:
        return tool_plan(chat, choice)
    except BadField as exc:  # the chat shape's names -> the Responses API's
        param = exc.param.replace(".function", "")
        raise BadField(param, str(exc).split(": ", 1)[-1]) from None


def text_schema(request: ResponseRequest) -> str:
    """The engine's json_schema for ``text.format`` ("" for text)."""
    fmt = request.text.format if request.text else None
    if not fmt:
        return ""
    kind = fmt.get("type")
    if kind == "text":
        return ""
    if kind == "json_object":
        return JSON_OBJECT
    if kind != "json_schema":
        raise BadField("text.format.type", f"must be text, json_object or json_schema, got {kind!r}")
    if not isinstance(fmt.get("name", ""), str):
        raise BadField("text.format.name", "must be a string")
    if not isinstance(fmt.get("strict", False), (bool, type(None))):
        raise BadField("text.format.strict", "must be a boolean")
    schema = fmt.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise BadField("text.format.schema", "must be a JSON Schema object")
    return json.dumps(schema)


def gen_config(request: ResponseRequest, plan: ToolPlan) -> GenConfig:
    return GenConfig(
        max_new_tokens=request.max_output_tokens or UNLIMITED_TOKENS,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        seed=secrets.randbelow(2**63) if request.seed is None else request.seed,
        json_schema=plan.schema or text_schema(request),
    )


# -- answers --------------------------------------------------------------------------------------


def output_items(text: str, plan: ToolPlan, parallel: bool, status: str, message_id: str) -> list[OutputItem]:
    """An answer as output items: its function calls, or one message (``message_id``)."""
    calls = plan.calls(text)
    if calls:
        items = [
            FunctionCallItem(id=new_id("fc"), call_id=c.id, name=c.name, arguments=c.arguments) for c in calls
        ]
        return items if parallel else items[:1]
    return [MessageItem(id=message_id, status=status, content=[OutputText(text=text)])]


def response_usage(started: Started, output_tokens: int) -> ResponseUsage:
    """The prompt is what the session reused (``cached_tokens``) plus what the engine prefilled."""
    input_tokens = started.position + started.input_positions
    return ResponseUsage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=started.position),
        output_tokens=output_tokens,
        total_tokens=input_tokens + output_tokens,
    )
