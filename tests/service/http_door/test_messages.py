"""Anthropic's Messages API on the HTTP door with the official ``anthropic`` client: answers checked
against the same conversation through /v1/chat/completions, usage against the engine's own
tokenization, ``cache_control`` breakpoints stored and read with exact counts (and the controls where
nothing is marked)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.service.helpers import wait_for
from tests.service.http_door.calls import MODEL, engine_idle, post, sdk
from tests.service.http_door.messages_calls import (
    GREEDY,
    SYSTEM,
    claude,
    common_prefix,
    engine_tokens,
    event_stream,
)

QUESTION = "What is the capital of France?"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    },
}


@pytest.fixture
def full_door(engine_factory, prefix_factory):
    """As ``prompts_door`` over an engine of full-attention layers only: its window never evicts, so
    the service takes no message-end checkpoints and every snapshot but the prompt's is a breakpoint's."""
    engine = engine_factory(max_session_tokens=1024, layers="FFFF")
    prefix = prefix_factory(engine.address, cache_generated=False)
    port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL)
    return engine, prefix, f"http://127.0.0.1:{port}"


def marked_system(text: str = SYSTEM) -> list[dict]:
    return [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]


def test_create_and_count_tokens_match_the_chat_route(door) -> None:
    """The same conversation through /v1/chat/completions (an independent rendering path) answers the
    same text and prompt size; count_tokens is the engine's own count of the rendered prompt."""
    engine, _, base = door
    client = claude(base)
    turns = [{"role": "user", "content": QUESTION}]
    message = client.messages.create(
        model=MODEL, max_tokens=8, system=SYSTEM, messages=turns, extra_body=GREEDY
    )
    chat = sdk(base).chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, messages=[{"role": "system", "content": SYSTEM}, *turns]
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    expected = len(engine_tokens(engine, [("system", SYSTEM), ("user", QUESTION)]))
    assert expected == chat.usage.prompt_tokens
    usage = message.usage
    assert (usage.input_tokens, usage.output_tokens) == (expected, 8)  # nothing marked: all input
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (0, 0)
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=turns)
    assert counted.input_tokens == expected


@pytest.mark.parametrize("door_name", ["full_door", "prompts_door"])  # full attention; sliding layers
def test_cache_control_on_a_long_system_prompt_is_read_by_the_next_request(request, door_name) -> None:
    """The first request writes the breakpoint (its positions counted as cache creation, a snapshot
    stored there beside the prompt's); a second with another user message reads exactly the
    breakpoint's positions, computed here from the engine's tokenization of the system turn alone."""
    engine, prefix, base = request.getfixturevalue(door_name)
    client = claude(base)
    head = engine_tokens(engine, [("system", SYSTEM)])
    full = engine_tokens(engine, [("system", SYSTEM), ("user", "Hello there")])
    breakpoint_ = common_prefix(head, full)  # (on the window engine also a message-end checkpoint)
    # chatml, one token per character: the system turn and the next turn's opening marker
    assert breakpoint_ == len(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>")

    def ask(user: str, system) -> tuple:
        turns = [{"role": "user", "content": user}]
        usage = client.messages.create(
            model=MODEL, max_tokens=3, system=system, messages=turns, extra_body=GREEDY
        ).usage
        total = client.messages.count_tokens(model=MODEL, system=system, messages=turns).input_tokens
        assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == total
        return usage.cache_read_input_tokens, usage.cache_creation_input_tokens, usage.input_tokens, total

    read, created, fresh, total = ask("Hello there", marked_system())
    assert (read, created, fresh) == (0, breakpoint_, total - breakpoint_)
    assert wait_for(lambda: engine_idle(engine, held=2))  # the breakpoint's snapshot and the prompt's
    assert len(prefix.server.gateway) == 2
    read, created, fresh, total = ask("Another question entirely", marked_system())
    assert (read, created, fresh) == (breakpoint_, 0, total - breakpoint_)
    # control: the same prefix unmarked reads and writes nothing (its reuse is not Anthropic's to count)
    read, created, fresh, total = ask("A third one", SYSTEM)
    assert (read, created, fresh) == (0, 0, total)


def test_without_cache_control_no_breakpoint_is_stored(full_door) -> None:
    """Negative control for the stored snapshot: the prompt's own, nothing at the system's end."""
    engine, prefix, base = full_door
    claude(base).messages.create(
        model=MODEL,
        max_tokens=2,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Hi"}],
        extra_body=GREEDY,
    )
    assert wait_for(lambda: engine_idle(engine, held=1)) and len(prefix.server.gateway) == 1


def test_a_breakpoint_inside_a_message_and_at_the_prompt_end(prompts_door) -> None:
    """cache_control on the first of two system blocks: the breakpoint ends with that block's text
    (blocks join with a newline); the top-level cache_control marks the prompt's end."""
    engine, _, base = prompts_door
    client = claude(base)
    first, second = "Block one of the system prompt.", "Block two."
    system = [
        {"type": "text", "text": first, "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": second},
    ]
    turns = [{"role": "user", "content": "Hi"}]
    usage = client.messages.create(
        model=MODEL, max_tokens=2, system=system, messages=turns, extra_body=GREEDY
    ).usage
    assert usage.cache_creation_input_tokens == len(f"<|im_start|>system\n{first}")
    assert len(engine_tokens(engine, [("system", f"{first}\n{second}"), ("user", "Hi")])) == (
        usage.input_tokens + usage.cache_creation_input_tokens
    )
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": turns,
        "cache_control": {"type": "ephemeral"},
        **GREEDY,
    }
    alone = engine_tokens(engine, [("user", "Hi")])
    total = len(alone)
    # the first request's stored prompt shares the turn's opening marker with this one: read; the
    # rest up to the breakpoint at the prompt's end is written
    shared = common_prefix(engine_tokens(engine, [("system", f"{first}\n{second}"), ("user", "Hi")]), alone)
    assert shared == len("<|im_start|>")
    once = post(base, "/v1/messages", body).json()["usage"]
    assert (once["cache_read_input_tokens"], once["cache_creation_input_tokens"], once["input_tokens"]) == (
        shared,
        total - shared,
        0,
    )
    again = post(base, "/v1/messages", body).json()["usage"]
    # the prompt's last position is always computed (its logits start the answer)
    assert (again["cache_read_input_tokens"], again["cache_creation_input_tokens"]) == (total - 1, 1)


def test_stream_sends_anthropics_event_sequence(door) -> None:
    _, _, base = door
    client = claude(base)
    turns = [{"role": "user", "content": QUESTION}]
    whole = client.messages.create(model=MODEL, max_tokens=10, messages=turns, extra_body=GREEDY)
    events = event_stream(
        base, {"model": MODEL, "max_tokens": 10, "messages": turns, "stream": True, **GREEDY}
    )
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == whole.content[0].text
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 10
    with client.messages.stream(model=MODEL, max_tokens=10, messages=turns, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.usage.output_tokens == 10 and final.stop_reason == "max_tokens"


def test_stop_sequences_cut_the_text(door) -> None:
    _, _, base = door
    client = claude(base)
    turns = [{"role": "user", "content": "hello there"}]
    reference = client.messages.create(model=MODEL, max_tokens=16, messages=turns, extra_body=GREEDY)
    text = reference.content[0].text
    k = next(i for i in range(1, len(text) - 1) if text[i] != text[i + 1])
    stop = text[k : k + 2]
    cut = client.messages.create(
        model=MODEL, max_tokens=16, messages=turns, stop_sequences=["never", stop], extra_body=GREEDY
    )
    assert cut.content[0].text == text[: text.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)


def test_a_forced_tool_call_and_its_result_round_trip(door) -> None:
    """tool_choice {"type": "tool"}: the answer is a tool_use block whose input validates against the
    tool's schema; the next turn carries it back with a tool_result and is answered (whole and
    streamed, the streamed call equal to the whole one)."""
    _, _, base = door
    client = claude(base)
    turns = [{"role": "user", "content": "Weather in Paris for two days?"}]
    forced = {"type": "tool", "name": "get_weather"}
    call = client.messages.create(
        model=MODEL, max_tokens=80, messages=turns, tools=[WEATHER], tool_choice=forced, extra_body=GREEDY
    )
    assert call.stop_reason == "tool_use" and [b.type for b in call.content] == ["tool_use"]
    use = call.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with client.messages.stream(
        model=MODEL, max_tokens=80, messages=turns, tools=[WEATHER], tool_choice=forced, extra_body=GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == use.input
    follow = [
        *turns,
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21C"}],
        },
    ]
    answer = client.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=follow,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert answer.stop_reason == "max_tokens" and answer.content[0].type == "text"
    counted = client.messages.count_tokens(
        model=MODEL, messages=follow, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert answer.usage.input_tokens == counted.input_tokens
    offered = client.messages.count_tokens(model=MODEL, messages=follow, tools=[WEATHER])
    assert offered.input_tokens > counted.input_tokens  # the tools are offered in the system turn


def test_a_breakpoint_on_a_tool_covers_the_offered_tools(full_door) -> None:
    """Tools come first in the system turn (Anthropic's cache order): a marked tool's breakpoint ends
    with its JSON line (the documented offer format), so another system text after it still reads it."""
    _, _, base = full_door
    client = claude(base)
    marked = {**WEATHER, "cache_control": {"type": "ephemeral"}}
    line = json.dumps(
        {
            "name": WEATHER["name"],
            "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"],
        }
    )
    turns = [{"role": "user", "content": "Hi"}]

    def usage(system: str):
        return client.messages.create(
            model=MODEL, max_tokens=2, system=system, tools=[marked], messages=turns, extra_body=GREEDY
        ).usage

    first = usage("First system text.")
    # chatml, one token per character: the system turn opens with the offer's first line, then the tool's
    offer_head = "You can call these functions (JSON Schema of their arguments):\n"
    assert first.cache_creation_input_tokens == len(f"<|im_start|>system\n{offer_head}{line}")
    second = usage("Another system text.")
    assert (second.cache_read_input_tokens, second.cache_creation_input_tokens) == (
        first.cache_creation_input_tokens,
        0,
    )
