"""The Responses and Messages APIs on the packaged SmolLM2-135M-Instruct through the three client
libraries no one here wrote (slow): the ``openai`` client's three-turn ``previous_response_id`` chain
(every earlier position cached, each turn answering as a cold engine run over ids computed here from
the tokenizer and the template), ``stream`` / ``retrieve`` / ``delete``; the OpenAI Agents SDK calling a
function tool and using its result; the ``anthropic`` client with ``cache_control`` on a long system
prompt (the second request reads exactly the breakpoint's positions), ``stream`` and ``count_tokens``.
Gemma 3 270M (a base model, no chat template) answers the same clients in plain text
(test_base_model_apis.py)."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest

from engine_service.api.prompts import TextPrompt, text_tokens
from tests.service.conftest import real_model_services
from tests.service.http_door.calls import cold_real, real_text

pytestmark = pytest.mark.slow

MODEL = "smollm2"
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
N = 16


@pytest.fixture(scope="module")
def smol():
    """(loaded model, engine sessions, base URL) of the packaged SmolLM2 behind the HTTP door."""
    with real_model_services(max_sessions=8) as (loaded, deps, prefix):
        port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL)
        yield loaded, deps, f"http://127.0.0.1:{port}"


def rendered(loaded, turns) -> list[int]:
    return text_tokens(TextPrompt("", chat=True, messages=tuple(turns)), loaded.tokenizer, loaded.chat)


def test_a_responses_chain_of_three_turns_on_smollm2(smol) -> None:
    loaded, deps, base = smol
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300)
    turns = [("system", INSTRUCTIONS)]
    questions = ["What is the capital of France?", "And of Germany?", "And of Italy?"]
    prompt: list[int] = []
    generated: list[int] = []
    previous = None
    for turn, question in enumerate(questions):
        if previous is None:
            turns.append(("user", question))
            prompt = rendered(loaded, turns)
        else:  # the exact continuation: the earlier ids, then the template's tokens after the answer
            before = rendered(loaded, turns)
            emptied = rendered(loaded, [*turns, ("assistant", ""), ("user", question)])
            assert emptied[: len(before)] == before
            kept = generated[:-1] if previous.status == "completed" else generated
            prompt = prompt + kept + emptied[len(before) :]
            turns += [("assistant", previous.output_text), ("user", question)]
        kwargs = {"previous_response_id": previous.id} if previous else {}
        response = client.responses.create(
            model=MODEL,
            input=question,
            instructions=INSTRUCTIONS,
            max_output_tokens=N,
            temperature=0,
            **kwargs,
        )
        generated = cold_real(loaded, deps, prompt, N)
        assert response.usage.input_tokens == len(prompt)
        assert response.usage.output_tokens == len(generated)
        assert response.output_text == real_text(loaded, generated)
        cached = response.usage.input_tokens_details.cached_tokens
        if previous is None:
            assert cached < len(prompt) // 2  # a new conversation: at most a shared template head
        else:  # every earlier position, generated ones included, but the last sampled token
            assert cached == previous.usage.input_tokens + previous.usage.output_tokens - 1 > turn * 20
        previous = response
    first = client.responses.retrieve(previous.previous_response_id)  # turn 2, stored
    assert first.previous_response_id and first.output_text

    # streamed, continuing the chain; then retrieve and delete
    with client.responses.stream(
        model=MODEL,
        input="Thanks!",
        instructions=INSTRUCTIONS,  # not carried over from the previous response (as OpenAI)
        previous_response_id=previous.id,
        max_output_tokens=8,
        temperature=0,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text
    assert final.usage.input_tokens_details.cached_tokens == (
        previous.usage.input_tokens + previous.usage.output_tokens - 1
    )
    assert client.responses.retrieve(final.id).output_text == final.output_text
    client.responses.delete(final.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(final.id)


def test_the_agents_sdk_calls_a_tool_on_smollm2(smol) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    _, _, base = smol
    calls: list[str] = []

    @agents.function_tool
    def capital(country: str) -> str:
        """The capital city of a country."""
        calls.append(country)
        return "Paris"

    async def run():
        client = AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        agent = agents.Agent(
            name="geographer",
            instructions="Use the capital tool, then answer with the city.",
            tools=[capital],
            model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=160),
        )
        return await agents.Runner.run(agent, "What is the capital of France?", max_turns=4)

    agents.set_tracing_disabled(True)
    result = asyncio.run(run())
    assert calls and all(isinstance(c, str) and c for c in calls)  # a constrained call, valid arguments
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)
    assert result.final_output.strip()


def test_anthropic_cache_control_on_a_long_system_prompt_on_smollm2(smol) -> None:
    loaded, _, base = smol
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=300)
    facts = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(1, 25))
    system = f"You answer questions about numbers. {facts}"
    block = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]

    def ask(question: str):
        return client.messages.create(
            model=MODEL,
            max_tokens=12,
            system=block,
            messages=[{"role": "user", "content": question}],
            extra_body={"temperature": 0},  # this client version has no temperature argument
        )

    whole = rendered(loaded, [("system", system), ("user", "What is 7 squared?")])
    head = rendered(loaded, [("system", system)])
    cut = next((i for i, (a, b) in enumerate(zip(whole, head, strict=False)) if a != b), len(head))
    assert 200 < cut < len(whole)

    first = ask("What is 7 squared?").usage
    assert first.cache_read_input_tokens < 10  # at most the template's head (the earlier tests' prompts)
    assert first.cache_read_input_tokens + first.cache_creation_input_tokens == cut
    assert first.input_tokens + cut == len(whole)
    second = ask("What is 9 squared?").usage
    assert second.cache_read_input_tokens == cut  # exactly the breakpoint's positions
    total = len(rendered(loaded, [("system", system), ("user", "What is 9 squared?")]))
    assert second.input_tokens + second.cache_read_input_tokens + second.cache_creation_input_tokens == total
    counted = client.messages.count_tokens(
        model=MODEL, system=block, messages=[{"role": "user", "content": "What is 9 squared?"}]
    )
    assert counted.input_tokens == total

    with client.messages.stream(
        model=MODEL, max_tokens=12, system=block, messages=[{"role": "user", "content": "And 5 squared?"}]
    ) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert text == message.content[0].text and message.usage.cache_read_input_tokens == cut
    assert json.loads(message.model_dump_json())["type"] == "message"
