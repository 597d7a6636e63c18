"""Gemma 3 270M (the packaged base model: no chat template) through the HTTP door's conversation routes
with the ``openai``, ``openai-agents`` and ``anthropic`` clients (slow). A conversation on a base model
is plain text (``convert.served``: its messages' texts, one paragraph each, after BOS): each answer
equals a cold engine run over ids computed here from the tokenizer, and a ``previous_response_id`` turn
continues the earlier ids exactly (every earlier position cached). Negative control: the engine itself
still refuses chat (test_gemma_services.py)."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import pytest

from engine_service.executors.options import ExecutorSettings
from engine_service.rpc.server import create_server
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED
from tests.service.conftest import start_prefix
from tests.service.http_door.calls import cold_real, real_text

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"
N = 8


@pytest.fixture(scope="module")
def gemma():
    """(loaded model, engine sessions, base URL) of the packaged Gemma 3 behind the HTTP door."""
    from engine_service.api.errors import ModelLoadError
    from engine_service.model.loading.loader import load_model

    try:
        loaded = load_model(MODEL)
    except ModelLoadError as exc:
        pytest.skip(f"{MODEL} unavailable: {exc}")
    deps = EngineSessions.build(
        loaded,
        loaded.tokenizer,
        model_name=MODEL,
        chat=loaded.chat,
        executor=ExecutorSettings(max_sessions=8, max_session_tokens=1024),
        sessions=UNLIMITED,
    )
    server, port = create_server(deps, "127.0.0.1:0")
    prefix = start_prefix(f"127.0.0.1:{port}")
    http = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL)
    yield loaded, deps, f"http://127.0.0.1:{http}"
    prefix.stop(0)
    server.stop(0, shutdown_runner=True)


def plain(loaded, *texts: str) -> list[int]:
    return list(loaded.tokenizer.encode("\n\n".join(texts), add_special_tokens=True))


def test_responses_and_chat_in_plain_text_on_gemma(gemma) -> None:
    loaded, deps, base = gemma
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300)
    first_text, second_text = "The capital of France is", "The capital of Germany is"
    prompt = plain(loaded, first_text)
    first = client.responses.create(model=MODEL, input=first_text, max_output_tokens=N, temperature=0)
    generated = cold_real(loaded, deps, prompt, N)
    assert first.usage.input_tokens == len(prompt) and first.output_text == real_text(loaded, generated)

    second = client.responses.create(
        model=MODEL, input=second_text, previous_response_id=first.id, max_output_tokens=N, temperature=0
    )
    before = plain(loaded, first_text)
    emptied = plain(loaded, first_text, second_text)  # the emptied answer is skipped
    assert emptied[: len(before)] == before
    kept = generated[:-1] if first.status == "completed" else generated
    ids = prompt + kept + emptied[len(before) :]
    assert second.usage.input_tokens == len(ids)
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + len(generated) - 1
    assert second.output_text == real_text(loaded, cold_real(loaded, deps, ids, N))

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": first_text}], max_tokens=N, temperature=0
    )
    assert chat.choices[0].message.content == real_text(loaded, generated)
    assert chat.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1  # the first response's prompt


def test_anthropic_messages_in_plain_text_on_gemma(gemma) -> None:
    loaded, deps, base = gemma
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=300)
    system, question = "A list of capitals.", "The capital of Spain is"
    message = client.messages.create(
        model=MODEL,
        max_tokens=N,
        system=system,
        messages=[{"role": "user", "content": question}],
        extra_body={"temperature": 0},  # this client version has no temperature argument
    )
    ids = plain(loaded, system, question)
    assert message.content[0].text == real_text(loaded, cold_real(loaded, deps, ids, N))
    counted = client.messages.count_tokens(
        model=MODEL, system=system, messages=[{"role": "user", "content": question}]
    )
    assert (
        counted.input_tokens == len(ids) == message.usage.input_tokens + message.usage.cache_read_input_tokens
    )


def test_an_agent_answers_in_plain_text_on_gemma(gemma) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    _, _, base = gemma

    async def run():
        client = AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        agent = agents.Agent(
            name="writer",
            instructions="Answer true or false.",
            model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(temperature=0, max_tokens=40),
            output_type=bool,  # a constrained JSON answer ends (a base model's free text rarely does)
        )
        return await agents.Runner.run(agent, "Paris is the capital of France:", max_turns=1)

    agents.set_tracing_disabled(True)
    result = asyncio.run(run())
    assert [item.type for item in result.new_items] == ["message_output_item"]
    assert isinstance(result.final_output, bool)
