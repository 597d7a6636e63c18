"""``/v1/responses`` through the official ``openai`` client: whole, streamed, stored (retrieve, delete,
input items), and ``previous_response_id`` continued exactly -- each later turn's prompt is the earlier
turns' token ids (computed here from the tokenizer and the template, not through the door), every
position of them cached, answering as a cold engine run over the same ids; negative controls: a new
conversation, a re-sent whole conversation and changed instructions reuse less."""

from __future__ import annotations

import json

import openai
import pytest

from engine_service.api.config import GenConfig
from engine_service.api.prompts import TextPrompt, text_tokens
from engine_service.model.text.chat import ChatFormatter
from prefix_service.http.tools import tool_plan, tool_response, tools_prompt
from tests.service.conftest import char_tokenizer
from tests.service.helpers import wait_for
from tests.service.http_door.calls import MODEL, engine_idle

TOKENIZER, TEMPLATE = char_tokenizer(), ChatFormatter(name="chatml")
SYSTEM = ("system", "Be brief.")
N = 12
WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def rendered(turns) -> list[int]:
    return text_tokens(TextPrompt("", chat=True, messages=tuple(turns)), TOKENIZER, TEMPLATE)


def continued(prompt: list[int], generated: list[int], turns, new_turns) -> list[int]:
    """The exact continuation: the earlier ids, then the template's tokens after the answer (read off
    the conversation with the answer emptied)."""
    before = rendered(turns)
    emptied = rendered([*turns, ("assistant", ""), *new_turns])
    assert emptied[: len(before)] == before
    return prompt + generated + emptied[len(before) :]


def encoded(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def cold_prompt(length: int, turns) -> list[int]:
    """The rendered ``turns``, checked to be ``length`` ids long (what the door reported)."""
    ids = rendered(turns)
    assert len(ids) == length
    return ids


def cold(engine, ids: list[int], n: int) -> list[int]:
    """A greedy run over ``ids`` on a fresh engine session (no cache)."""
    with engine.runner.open_session() as session:
        return list(
            session.generate_async(ids, GenConfig(max_new_tokens=n, stop_tokens=(2,))).wait(60).tokens
        )


def ask(client: openai.OpenAI, text: str, **kw):
    return client.responses.create(
        model=MODEL, input=text, instructions=SYSTEM[1], max_output_tokens=N, temperature=0, **kw
    )


def test_a_chain_of_three_turns_is_continued_exactly(door, client) -> None:
    engine, prefix, _ = door
    turns, prompt, previous = [SYSTEM], [], None
    for turn, text in enumerate(["Hello there", "Tell me more", "And then?"]):
        turns.append(("user", text))
        if previous is None:
            prompt = rendered(turns)
        response = ask(client, text, previous_response_id=previous and previous.id)
        generated = cold(engine, prompt, N)
        assert response.usage.input_tokens == len(prompt)
        assert response.output_text == TOKENIZER.decode(generated, skip_special_tokens=True)
        assert response.usage.output_tokens == len(generated) == N  # the tiny model never ends
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        if previous is None:
            assert response.usage.input_tokens_details.cached_tokens == 0
        else:  # every earlier position, generated ones included, but the last sampled token (pending:
            # the engine never ran it, so the snapshot ends before it)
            expected = previous.usage.input_tokens + previous.usage.output_tokens - 1
            assert response.usage.input_tokens_details.cached_tokens == expected > turn * N
        previous = response
        answer = ("assistant", response.output_text)
        nxt = ("user", ["Tell me more", "And then?", ""][turn])
        prompt = continued(prompt, generated, turns, [nxt])
        turns.append(answer)
    # negative controls: a new conversation shares the system turn only; the first turn's branch
    fresh = ask(client, "And then?")
    assert fresh.usage.input_tokens_details.cached_tokens < len(rendered([SYSTEM]))
    assert engine_idle(engine, held=len(prefix.cache))


def test_a_forced_tool_call_turn_is_continued_exactly(door, client) -> None:
    """The call's answer re-renders differently (``<tool_call>`` around it): re-sent whole the
    conversation reuses only the first prompt, continued it reuses every position, the call's
    end-of-sequence token dropped for the template's end of turn."""
    engine, _, _ = door
    first = client.responses.create(
        model=MODEL, input="Weather?", tools=[WEATHER], tool_choice={"type": "function", "name": "weather"}
    )
    assert first.status == "completed"
    [call] = first.output
    assert (
        call.type == "function_call"
        and call.name == "weather"
        and json.loads(call.arguments) == {"city": "Paris"}
    )
    p1 = first.usage.input_tokens
    answer = json.dumps({"name": "weather", "arguments": {"city": "Paris"}})
    assert first.usage.output_tokens == len(answer) + 1  # ... and the end-of-sequence token
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = client.responses.create(
        model=MODEL,
        input=[result],
        tools=[WEATHER],
        previous_response_id=first.id,
        max_output_tokens=N,
        temperature=0,
    )
    assert second.usage.input_tokens_details.cached_tokens == p1 + len(answer)
    turns = [
        ("system", tools_prompt(tool_plan([{"type": "function", "function": WEATHER}], "auto"))),
        ("user", "Weather?"),
    ]
    assert rendered(turns) == cold_prompt(p1, turns)
    ids = continued(rendered(turns), encoded(answer), turns, [("user", tool_response("sunny", call.call_id))])
    assert second.usage.input_tokens == len(ids)
    assert second.output_text == TOKENIZER.decode(cold(engine, ids, N))
    whole = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Weather?"}, call.model_dump(exclude_none=True), result],
        tools=[WEATHER],
        max_output_tokens=N,
        temperature=0,
    )
    assert p1 <= whole.usage.input_tokens_details.cached_tokens < p1 + len(answer) // 2
    assert whole.usage.input_tokens != second.usage.input_tokens  # not the same ids


def test_changed_instructions_re_render_and_an_evicted_snapshot_is_recomputed(door, client) -> None:
    engine, prefix, _ = door
    first = ask(client, "Hello there")
    turns = [SYSTEM, ("user", "Hello there"), ("assistant", first.output_text), ("user", "More")]
    changed = client.responses.create(
        model=MODEL,
        input="More",
        instructions="Be long.",
        previous_response_id=first.id,
        max_output_tokens=N,
        temperature=0,
    )
    ids = rendered([("system", "Be long."), *turns[1:]])
    assert changed.usage.input_tokens == len(ids)  # the conversation as the template renders it
    assert changed.usage.input_tokens_details.cached_tokens < len(rendered([SYSTEM]))
    assert changed.output_text == TOKENIZER.decode(cold(engine, ids, N))
    prefix.server.deps.clear()  # every snapshot evicted: recomputed, never an error
    again = ask(client, "More", previous_response_id=first.id)
    assert again.usage.input_tokens_details.cached_tokens == 0
    ids = continued(rendered(turns[:2]), encoded(first.output_text), turns[:2], turns[3:])
    assert again.usage.input_tokens == len(ids)
    assert again.output_text == TOKENIZER.decode(cold(engine, ids, N))
    assert wait_for(lambda: engine_idle(engine, held=len(prefix.cache)), timeout=10)


def test_streamed_responses_follow_the_documented_events(client) -> None:
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=5, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == 5
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    with client.responses.stream(model=MODEL, input="Is it?", text=fmt, max_output_tokens=40) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(json.loads(final.output_text)["ok"], bool)
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_streamed_tool_call_and_a_streamed_continuation(client) -> None:
    events = list(
        client.responses.create(
            model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required", stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    [call] = final.output
    assert json.loads(call.arguments) == {"city": "Paris"} and events[3].delta == call.arguments
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    with client.responses.stream(
        model=MODEL,
        input=[result],
        previous_response_id=final.id,
        tools=[WEATHER],
        max_output_tokens=40,
        text={"format": {"type": "json_object"}},
    ) as stream:
        second = stream.get_final_response()
    usage = final.usage
    assert second.usage.input_tokens_details.cached_tokens == usage.input_tokens + usage.output_tokens - 1
    assert isinstance(json.loads(second.output_text), dict)


def test_stored_responses_are_retrieved_listed_and_deleted(client) -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Yes?"}]},
        {"role": "user", "content": "Go on"},
    ]
    created = client.responses.create(model=MODEL, input=items, max_output_tokens=3, metadata={"k": "v"})
    got = client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump() and got.metadata == {"k": "v"}
    listed = client.responses.input_items.list(created.id, order="asc")
    assert [i.role for i in listed.data] == ["developer", "user", "assistant", "user"]
    assert [i.content[0].text for i in listed.data] == ["Be brief.", "Hi", "Yes?", "Go on"]
    page = client.responses.input_items.list(created.id, limit=2)  # newest first, as OpenAI
    assert [i.content[0].text for i in page.data] == ["Go on", "Yes?"] and page.has_more
    deleted = client.responses.delete(created.id)
    assert deleted is None  # the client returns nothing; the door answered {"deleted": true}
    for call in (
        lambda: client.responses.retrieve(created.id),
        lambda: client.responses.delete(created.id),
        lambda: ask(client, "More", previous_response_id=created.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        ask(client, "More", previous_response_id=unstored.id)
