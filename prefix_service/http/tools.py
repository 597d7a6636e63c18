"""Tools (function calling) for chat requests in a format forkline documents: the tools written into the
system prompt, calls read back as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (constrained
by the engine's JSON-schema decoding for ``required`` / a named function). Spec: docs/HTTP.md#tools-and-tool_choice."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from prefix_service.http.errors import BadField

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(\{.*?\})\s*(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def offer(self) -> str:
        return json.dumps({"name": self.name, "description": self.description, "parameters": self.parameters})


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class ToolPlan:
    """What a request's ``tools`` / ``tool_choice`` ask of this generation. ``tools`` empty: none
    offered. ``schema``: the engine's json_schema ("" unless a call is forced)."""

    tools: tuple[Tool, ...] = ()
    schema: str = ""

    @property
    def active(self) -> bool:
        return bool(self.tools)

    @property
    def forced(self) -> bool:
        return bool(self.schema)

    def calls(self, text: str) -> tuple[ToolCall, ...]:
        """The calls in an answer (forced: the whole answer is one call); () when it calls nothing."""
        if not self.active:
            return ()
        found = [text] if self.forced else _CALL.findall(text)
        names = {t.name for t in self.tools}
        out = []
        for body in found:
            try:
                value = json.loads(body)
            except json.JSONDecodeError:
                continue
            if (
                isinstance(value, dict)
                and value.get("name") in names
                and isinstance(value.get("arguments"), dict)
            ):
                out.append(
                    ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], json.dumps(value["arguments"]))
                )
        return tuple(out)


def tool_plan(tools: list[dict] | None, tool_choice: str | dict | None) -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` (400 naming the field) and say what they ask."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise BadField("tool_choice", "needs tools")
        return ToolPlan()
    offered = tuple(_tool(t, i) for i, t in enumerate(tools))
    if len({t.name for t in offered}) != len(offered):
        raise BadField("tools", "function names must be unique")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan()
    if choice == "auto":
        return ToolPlan(offered)
    if choice == "required":
        return ToolPlan(offered, json.dumps({"anyOf": [_call_schema(t) for t in offered]}))
    function = _function(choice)
    if function is not None:
        name = function.get("name")
        named = [t for t in offered if t.name == name]
        if not named:
            raise BadField("tool_choice.function.name", f"no tool is named {name!r}")
        return ToolPlan(offered, json.dumps(_call_schema(named[0])))
    raise BadField(
        "tool_choice", "must be none, auto, required or {'type': 'function', 'function': {'name': ...}}"
    )


def _tool(value: object, index: int) -> Tool:
    where = f"tools[{index}]"
    fn = _function(value)
    if fn is None:
        raise BadField(where, "must be {'type': 'function', 'function': {...}}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadField(f"{where}.function.name", "must be 1-64 letters, digits, '_' or '-'")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise BadField(f"{where}.function.description", "must be a string")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise BadField(f"{where}.function.parameters", "must be a JSON Schema object")
    return Tool(name, description, parameters)


def _function(value: object) -> dict | None:
    """``value["function"]`` when ``value`` is ``{"type": "function", "function": {...}}``, else None."""
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
    ):
        return value["function"]
    return None


def _call_schema(tool: Tool) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tools_prompt(plan: ToolPlan) -> str:
    """The system-prompt text that offers the plan's tools ("" when none are offered)."""
    if not plan.active:
        return ""
    offers = "\n".join(t.offer() for t in plan.tools)
    return (
        "You can call these functions (JSON Schema of their arguments):\n"
        f"{offers}\n"
        "To call one, answer with nothing but "
        f'{CALL_OPEN}{{"name": "<function name>", "arguments": {{<arguments>}}}}{CALL_CLOSE}'
    )


def call_text(calls: Sequence[dict], index: int) -> str:
    """An assistant message's ``tool_calls`` written back as the model would have answered them."""
    parts = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadField(f"messages[{index}].tool_calls[{j}].function", "must have a name and arguments")
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            raise BadField(
                f"messages[{index}].tool_calls[{j}].function.arguments", "must be JSON text"
            ) from None
        parts.append(f"{CALL_OPEN}{json.dumps({'name': fn['name'], 'arguments': arguments})}{CALL_CLOSE}")
    return "".join(parts)


def tool_response(content: str, tool_call_id: str | None) -> str:
    """A ``tool`` message as the user turn the model reads."""
    return f"<tool_response>{json.dumps({'tool_call_id': tool_call_id or '', 'content': content})}</tool_response>"
