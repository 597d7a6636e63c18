"""The HTTP door's chat completions over real sockets (the official ``openai`` client and raw HTTP):
prompt reuse across calls and turns, streaming, stop strings, usage chunks, messages on the engine API,
the real model's chat template."""

from __future__ import annotations

import httpx
import pytest

from tests.service.conftest import start_prefix
from tests.service.helpers import wait_for
from tests.service.http_door.calls import MODEL, QUESTION, engine_idle, post, sdk, sse_events


def test_chat_non_streaming_and_the_second_call_reuses_the_prompt(prompts_door) -> None:
    engine, prefix, base = prompts_door
    client = sdk(base)
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0)
    assert first.object == "chat.completion" and first.model == MODEL
    choice = first.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert second.choices[0].message.content == choice.message.content and choice.message.content
    # chatml around the question, one token per character
    prompt = len("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (
        prompt,
        6,
        prompt + 6,
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert wait_for(lambda: engine_idle(engine, held=1))  # only the stored prompt snapshot


def test_chat_streaming_matches_non_streaming(client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def two_turns(client):
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    answer = first.choices[0].message.content
    conversation = QUESTION + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    second = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=4, temperature=0)
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
    assert second.usage.prompt_tokens == len(rendered + "<|im_start|>assistant\n")
    assert first.choices[0].finish_reason == "length" and len(answer) == first.usage.completion_tokens == 4
    return first, second


def test_multi_turn_chat_reuses_the_earlier_turns(door, client) -> None:
    """The whole conversation goes through the template; the next turn's prompt extends the stored
    generated snapshot of the previous one (its prompt and the answer but its pending last token), so
    all of that is reused (one token per character: the answer renders as it was generated)."""
    first, second = two_turns(client)
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + 4 - 1


def test_without_generated_snapshots_the_next_turn_reuses_the_previous_prompt(prompts_door) -> None:
    """Negative control (--no-cache_generated): everything up to the previous generation prompt."""
    first, second = two_turns(sdk(prompts_door[2]))
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens


def test_messages_travel_through_the_engine_api(door) -> None:
    """TextInput.messages on gRPC: rendered by the engine's template; mixed with text/system or
    without chat it is refused naming the field."""
    import grpc

    from protos import engine_pb2 as pb
    from protos import engine_pb2_grpc

    engine = door[0]
    turns = [pb.ChatMessage(role="user", content="Hi"), pb.ChatMessage(role="assistant", content="Yo")]
    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        ids = stub.Tokenize(pb.TokenizeRequest(text=pb.TextInput(chat=True, messages=turns))).ids
        assert "".join(map(chr, ids)) == (
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n<|im_start|>assistant\n"
        )
        for bad, field in (
            (pb.TextInput(chat=True, text="x", messages=turns), "text.messages"),
            (pb.TextInput(messages=turns), "text.messages"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.Tokenize(pb.TokenizeRequest(text=bad))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()


def test_stop_strings_cut_the_text_and_end_the_generation(prompts_door) -> None:
    engine, _, base = prompts_door
    hello = [{"role": "user", "content": "hello there"}]  # the tiny model answers "\n\nlll..."
    request = {"model": MODEL, "messages": hello, "max_tokens": 16, "temperature": 0}
    reference = post(base, "/v1/chat/completions", request).json()["choices"][0]["message"]["content"]
    # two different characters (two tokens, matched on the text) that do not open the answer
    k = next(i for i in range(1, len(reference) - 1) if reference[i] != reference[i + 1])
    stop = reference[k : k + 2]
    cut = reference.index(stop)
    assert cut > 0, reference
    stopped = post(base, "/v1/chat/completions", request | {"stop": ["never", stop]}).json()
    assert stopped["choices"][0]["message"]["content"] == reference[:cut]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == cut + len(stop)  # no token past the stop string
    with httpx.stream(
        "POST", base + "/v1/chat/completions", json=request | {"stop": stop, "stream": True}
    ) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == reference[:cut]
    assert wait_for(lambda: engine_idle(engine, held=1))


def test_include_usage_adds_one_final_usage_chunk(door) -> None:
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", door[2] + "/v1/chat/completions", json=body) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = sse_events(s)
    usage_chunk, done = events[-2:]
    assert done == "[DONE]" and usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert all(e["usage"] is None for e in events[:-2])
    assert events[-3]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_the_real_model_answers_through_its_chat_template() -> None:
    """SmolLM2-135M-Instruct via the openai client: the chat template in the engine, a real answer,
    and the second call reusing all but the last prompt token."""
    from engine_service.executors.options import ExecutorSettings
    from engine_service.model.loading.loader import load_model
    from engine_service.rpc.server import create_server
    from engine_service.sessions.engine import EngineSessions
    from engine_service.sessions.settings import UNLIMITED

    loaded = load_model()
    deps = EngineSessions.build(
        loaded,
        loaded.tokenizer,
        model_name=loaded.path,
        chat=loaded.chat,
        executor=ExecutorSettings(max_sessions=4, max_session_tokens=512),
        sessions=UNLIMITED,
    )
    server, port = create_server(deps, "127.0.0.1:0")
    prefix = start_prefix(f"127.0.0.1:{port}")
    try:
        http_port = prefix.server.start_http("127.0.0.1", 0)  # the model id: the engine's file name
        client = sdk(f"http://127.0.0.1:{http_port}")
        model = client.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct.Q4_1"  # the README's example uses this id
        messages = [{"role": "system", "content": "You are a helpful assistant."}, QUESTION[0]]
        answers = [
            client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
            for _ in range(2)
        ]
        prompt = loaded.tokenizer.encode(loaded.chat.format(messages))
        assert [a.usage.prompt_tokens for a in answers] == [len(prompt)] * 2
        assert [a.usage.prompt_tokens_details.cached_tokens for a in answers] == [0, len(prompt) - 1]
        assert "Paris" in answers[0].choices[0].message.content
        assert answers[1].choices[0].message.content == answers[0].choices[0].message.content
        streamed = client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0, stream=True, stop=["Paris"]
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == answers[0].choices[0].message.content.split("Paris")[0]
    finally:
        prefix.stop(0)
        server.stop(0, shutdown_runner=True)
