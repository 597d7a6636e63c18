"""The HTTP door's tool format (prefix_service/http/tools.py): plans, parsing an answer's calls, and
rendering a conversation's calls and tool answers back."""

from __future__ import annotations

import json

import pytest

from prefix_service.http.errors import BadField
from prefix_service.http.tools import CALL_CLOSE, CALL_OPEN, call_text, tool_plan, tools_prompt

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_auto_parses_calls_in_the_text_and_ignores_the_rest() -> None:
    plan = tool_plan(TOOLS, None)
    assert plan.active and not plan.forced and "add" in tools_prompt(plan)
    text = f'Sure. {CALL_OPEN}{{"name": "add", "arguments": {{"a": 1}}}}{CALL_CLOSE}'
    (call,) = plan.calls(text)
    assert call.name == "add" and json.loads(call.arguments) == {"a": 1}
    assert plan.calls("no call here") == ()
    assert plan.calls(f'{CALL_OPEN}{{"name": "sub", "arguments": {{}}}}{CALL_CLOSE}') == ()  # unknown name
    assert plan.calls(f"{CALL_OPEN}not json{CALL_CLOSE}") == ()


def test_forced_plans_constrain_to_the_call_schema() -> None:
    named = tool_plan(TOOLS, {"type": "function", "function": {"name": "add"}})
    schema = json.loads(named.schema)
    assert schema["properties"]["name"] == {"const": "add"} and schema["required"] == ["name", "arguments"]
    assert json.loads(tool_plan(TOOLS, "required").schema)["anyOf"][0] == schema
    assert not tool_plan(TOOLS, "none").active
    (call,) = named.calls('{"name": "add", "arguments": {}}')
    assert call.arguments == "{}"


def test_calls_render_back_as_the_model_writes_them() -> None:
    text = call_text(
        [{"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}], 1
    )
    assert tool_plan(TOOLS, None).calls(text)[0].arguments == '{"a": 2}'
    with pytest.raises(BadField, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        call_text([{"function": {"name": "add", "arguments": "{"}}], 1)
