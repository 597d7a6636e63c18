"""``tools`` / ``tool_choice`` through the HTTP door with the official ``openai`` client over real
servers (tiny random model, one token per character): a named function and ``required`` always give a
valid call (constrained by the parameters' schema; jsonschema validates), whole and streamed, with
``finish_reason: "tool_calls"``; the next turn's ``tool`` message is accepted and reuses the prior
turn's prompt; ``none`` / ``auto`` answer in text when the model calls nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.service.openai_door import MODEL, openai_door

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Local time.", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with openai_door(max_session_tokens=2048) as door:
        yield door.client


def check_call(call, names=tuple(SCHEMAS)) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1])
def test_a_named_function_is_always_a_valid_call(client, seed) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    request = dict(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=200,
        temperature=1.0,
        seed=seed,
    )
    answer = client.chat.completions.create(**request)
    c = answer.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    check_call(c.message.tool_calls[0], ("get_weather",))
    chunks = list(client.chat.completions.create(**request, stream=True))
    calls = [tc for ch in chunks for x in ch.choices for tc in (x.delta.tool_calls or [])]
    assert [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason] == [
        "tool_calls"
    ]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == json.loads(c.message.tool_calls[0].function.arguments)


def test_required_picks_one_of_the_tools_and_the_next_turn_reuses_the_prompt(client) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=200, seed=3
    )
    call = first.choices[0].message.tool_calls[0]
    check_call(call)
    follow_up = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    # auto (the default with tools): the tiny model calls nothing, so it answers in text
    second = client.chat.completions.create(
        model=MODEL, messages=follow_up, tools=TOOLS, max_tokens=8, seed=3
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content is not None
    # the prior turn's whole prompt was reused (its stored snapshot), the new turns computed
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_none_and_bad_tool_fields(client) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, seed=1)
    none = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=6, seed=1
    )
    assert none.choices[0].message.content == plain.choices[0].message.content  # tools not offered
    for kwargs, param in [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **kwargs)
        assert info.value.body["param"] == param
