"""The OpenAI-compatible HTTP door over real sockets: the official ``openai`` client and raw HTTP.

A tiny engine (char tokenizer: one token per character, chatml template) behind a prefix service
whose HTTP door is started like ``forkline-prefix --http_port 0`` does (``PrefixServer.start_http``).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import openai
import pytest
from starlette.applications import Starlette

from clients.engine_client import EngineClient
from prefix_service.__main__ import connect_and_serve
from prefix_service.__main__ import parse_args as prefix_args
from prefix_service.http.server import HttpServer
from tests.service.conftest import start_engine, start_prefix
from tests.service.helpers import wait_for

MODEL = "tiny"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def door(engine_factory, prefix_factory):
    """(engine, prefix service, base URL) with the HTTP door on a free port."""
    engine = engine_factory(max_session_tokens=1024)
    prefix = prefix_factory(engine.address)
    port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL)
    return engine, prefix, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def shared_base() -> Iterator[str]:
    """One door for the tests that only read answers (no engine state): the base URL."""
    engine = start_engine(max_session_tokens=1024)
    prefix = start_prefix(engine.address)
    port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL)
    yield f"http://127.0.0.1:{port}"
    prefix.stop(0)
    engine.stop(0)


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def client(door) -> openai.OpenAI:
    return sdk(door[2])


def post(base: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(
        base + path, content=content, headers={"content-type": "application/json"}, timeout=30, **kw
    )


def sse_events(response: httpx.Response) -> list:
    """The ``data:`` payloads of an event stream, parsed (``[DONE]`` kept as the string)."""
    lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def engine_idle(engine, held: int) -> bool:
    """Only the ``held`` stored snapshots are left in the engine: no generation session, no clone."""
    info = EngineClient(engine.address).info()
    return info.resident_sessions == held and info.open_handles == held


# -- the official client ----------------------------------------------------------------------------


def test_chat_non_streaming_and_the_second_call_reuses_the_prompt(door, client) -> None:
    engine, prefix, _ = door
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


def test_completions_text_tokens_and_stream(client) -> None:
    whole = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len("The quick brown fox") + 1  # + BOS (special tokens on)
    streamed = client.completions.create(
        model=MODEL,
        prompt="The quick brown fox",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1
    ids = [1] + [ord(c) for c in "The quick brown fox"]  # the same prompt as token ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == whole.choices[0].text
    assert by_ids.usage.prompt_tokens_details.cached_tokens == len(ids) - 1


def test_multi_turn_chat_reuses_the_earlier_turns(door, client) -> None:
    """The whole conversation goes through the template; the next turn's prompt extends the stored
    prompt of the previous one, so everything up to its generation prompt is reused."""
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    answer = first.choices[0].message.content
    conversation = QUESTION + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    second = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=4, temperature=0)
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
    assert second.usage.prompt_tokens == len(rendered + "<|im_start|>assistant\n")
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


def test_models_and_health(shared_base) -> None:
    assert [m.id for m in sdk(shared_base).models.list()] == [MODEL]
    assert httpx.get(shared_base + "/health").json() == {"status": "ok"}


def test_responses_are_not_held_back_by_nagle() -> None:
    """asyncio turns Nagle off only on connections of a socket made with IPPROTO_TCP; without it
    every whole (non-streamed) response waited ~40 ms for a delayed ACK."""
    http = HttpServer.start(Starlette(), "127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", http.port)) as client:
            client.sendall(b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
            assert client.recv(100).startswith(b"HTTP/1.1 404")
        assert http._socket.proto == socket.IPPROTO_TCP
    finally:
        http.stop(0)


@pytest.mark.parametrize(
    ("kwargs", "exception", "param"),
    [
        ({"n": 17}, openai.BadRequestError, "n"),
        ({"model": "gpt-4o"}, openai.NotFoundError, "model"),
        ({"temperature": 3.0}, openai.BadRequestError, "temperature"),
        ({"stop": ""}, openai.BadRequestError, "stop"),
        ({"top_logprobs": 2}, openai.BadRequestError, "top_logprobs"),  # without logprobs: true
        ({"response_format": {"type": "xml"}}, openai.BadRequestError, "response_format.type"),
        ({"messages": [{"role": "user", "content": "x" * 2000}]}, openai.BadRequestError, None),  # too long
    ],
)
def test_errors_surface_as_the_sdks_exceptions(shared_base, kwargs, exception, param) -> None:
    request = {"model": MODEL, "messages": QUESTION, "max_tokens": 2} | kwargs
    with pytest.raises(exception) as info:
        sdk(shared_base).chat.completions.create(**request)
    assert info.value.body["param"] == param and info.value.body["message"]


# -- raw HTTP ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (b"{", None, "not valid JSON"),
        (b"", None, "empty"),
        (b"[1, 2]", None, "JSON object"),
        ({"model": MODEL}, "messages", "required"),
        ({"messages": QUESTION}, "model", "required"),
        ({"model": MODEL, "messages": "hi"}, "messages", "array"),
        ({"model": MODEL, "messages": []}, "messages", "at least 1"),
        ({"model": MODEL, "messages": [{"role": "user"}], "max_tokens": "3"}, "max_tokens", "integer"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "system"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
        ({"model": MODEL, "messages": QUESTION, "stream": "yes"}, "stream", "boolean"),
        ({"model": MODEL, "messages": QUESTION, "stop": ["a", 1]}, "stop", "string"),
        ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
            "text parts",
        ),
        ({"model": MODEL, "messages": QUESTION, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)
def test_malformed_chat_bodies_are_400_naming_the_field(shared_base, body, param, says) -> None:
    response = post(shared_base, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert says in error["message"] and (param is None or param.split("[")[0] in error["message"])


def test_unknown_routes_and_methods_answer_in_openai_shape(shared_base) -> None:
    base = shared_base
    assert httpx.get(base + "/v1/nothing").json()["error"]["code"] == "unknown_route"
    wrong = httpx.get(base + "/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
    too_many = post(base, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"


def test_stop_strings_cut_the_text_and_end_the_generation(door) -> None:
    engine, _, base = door
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


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_leaves_no_engine_session(door, stream) -> None:
    """A long generation (900 tokens) is ended when its client leaves, long before it would finish."""
    engine, _, base = door
    body = {"model": MODEL, "prompt": "a", "max_tokens": 900, "temperature": 0, "stream": stream}
    decoded_before = engine.runner.metrics().tokens_decoded
    with httpx.Client(timeout=httpx.Timeout(30, read=None if stream else 0.3)) as http:
        if stream:
            with http.stream("POST", base + "/v1/completions", json=body) as s:
                assert next(line for line in s.iter_lines() if line.startswith("data: "))
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(base + "/v1/completions", json=body)
    assert wait_for(lambda: engine_idle(engine, held=1), timeout=10)
    assert engine.runner.metrics().tokens_decoded - decoded_before < 900  # ended, not run out


def test_the_prefix_service_flag_starts_the_door(engine, capsys) -> None:
    """``forkline-prefix --http_port 0`` wiring (in-process): the model id is the engine's model name."""
    args = prefix_args(["--engine", engine.address, "--port", "0", "--http_port", "0"])
    server, _ = connect_and_serve(args)
    try:
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert line.startswith("forkline-prefix HTTP listening on 127.0.0.1:")
        models = httpx.get(f"http://{line.rsplit(' ', 1)[1]}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [engine.deps.model_name]
    finally:
        server.stop(0)
    assert prefix_args(["--engine", "x:1"]).http_port is None  # off by default


def test_engine_down_is_503(door) -> None:
    engine, _, base = door
    engine.stop(0)
    response = post(base, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 2})
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(base + "/health").status_code == 503


def test_stopping_the_prefix_service_stops_its_http_door(door) -> None:
    engine, prefix, base = door
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST",
            base + "/v1/completions",
            json={"model": MODEL, "prompt": "a", "max_tokens": 900, "stream": True},
        ) as s,
    ):
        assert next(line for line in s.iter_lines() if line.startswith("data: "))
        prefix.stop(0.2, release=True)
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/health")
    assert wait_for(lambda: engine_idle(engine, held=0), timeout=10)


# -- the real model ---------------------------------------------------------------------------------


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


def test_the_door_routes_over_several_engines(engine_factory) -> None:
    """One prefix service over two engines: a repeated chat reuses its prompt, and under cache_aware
    (pinned: the default cost policy spreads such misses instead, tests/service/test_routing_tenants.py)
    a new question goes to the engine holding the longest shared prefix (the chat template's header)."""
    from prefix_service.engines.connect import connect_fleet
    from prefix_service.fleet.routing import routing_policy
    from prefix_service.rpc.server import create_server

    engines = [engine_factory(max_session_tokens=1024) for _ in range(2)]
    fleet, pool = connect_fleet(
        lambda: {e.address for e in engines},
        policy=routing_policy("cache_aware"),
        ready_timeout=10,
        resolve_every_s=60,
    )
    server, _ = create_server(fleet, "127.0.0.1:0", pool=pool)
    try:
        client = sdk(f"http://127.0.0.1:{server.start_http('127.0.0.1', 0, model_name=MODEL)}")
        questions = [
            [{"role": "user", "content": f"{q} is the capital of France?"}] for q in ("What", "Which city")
        ]
        header = len("<|im_start|>user\n")  # what the two chats share (one token per character)
        for i, messages in enumerate(questions):
            first = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, temperature=0
            )
            again = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, temperature=0
            )
            assert first.usage.prompt_tokens_details.cached_tokens == (0 if i == 0 else header + 2)  # + "Wh"
            assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
            assert again.choices[0].message.content == first.choices[0].message.content
        assert sorted(e.stats.cache.entries for e in fleet.stats().engines) == [
            0,
            2,
        ]  # both where the header is
    finally:
        server.stop(0)
