"""/tokenize and /detokenize in llama-server's and vLLM's request shapes, checked against the engine's
own Tokenize / Detokenize (gRPC) and the chat route's prompt count; bad input is a 400 naming the
field (OpenAI's error shape, as the rest of the door)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clients.engine_client import EngineClient
from tests.service.http_door.calls import MODEL, QUESTION, post, sdk
from tests.service.http_door.messages_calls import engine_tokens
from tests.service.test_http_fuzz import FUZZ, JSON, check

TEXT = "Hello, world"


def test_llama_server_shapes(door) -> None:
    engine, _, base = door
    reference = EngineClient(engine.address)
    plain = post(base, "/tokenize", {"content": TEXT}).json()
    assert plain["tokens"] == reference.tokenize(TEXT)  # llama-server's default: no special tokens
    assert plain["count"] == len(TEXT) and plain["max_model_len"] == 1024
    special = post(base, "/tokenize", {"content": TEXT, "add_special": True}).json()["tokens"]
    assert special == reference.tokenize(TEXT, add_special_tokens=True) and special != plain["tokens"]
    pieces = post(base, "/tokenize", {"content": TEXT, "with_pieces": True}).json()["tokens"]
    assert pieces == [{"id": i, "piece": reference.detokenize([i])} for i in plain["tokens"]]
    back = post(base, "/detokenize", {"tokens": plain["tokens"]}).json()
    assert back == {"content": reference.detokenize(plain["tokens"]), "prompt": TEXT}


def test_vllm_shapes(door) -> None:
    engine, _, base = door
    reference = EngineClient(engine.address)
    prompt = post(base, "/tokenize", {"model": MODEL, "prompt": TEXT}).json()
    assert prompt["tokens"] == reference.tokenize(TEXT, add_special_tokens=True)  # vLLM's default
    assert prompt["count"] == len(prompt["tokens"]) and prompt["max_model_len"] == 1024
    strs = post(base, "/tokenize", {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True})
    assert strs.json()["token_strs"] == list(TEXT)
    chat = post(base, "/tokenize", {"model": MODEL, "messages": QUESTION}).json()
    assert chat["tokens"] == engine_tokens(engine, [("user", QUESTION[0]["content"])])
    answer = sdk(base).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens
    assert post(base, "/detokenize", {"model": MODEL, "tokens": chat["tokens"]}).json()["prompt"] == (
        reference.detokenize(chat["tokens"])
    )


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/tokenize", {}, "content"),
        ("/tokenize", {"content": "a", "prompt": "b"}, "content"),
        ("/tokenize", {"content": 3}, "content"),
        (
            "/tokenize",
            {"content": "a", "add_special": True, "add_special_tokens": False},
            "add_special_tokens",
        ),
        ("/tokenize", {"messages": QUESTION, "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"messages": QUESTION, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/tokenize", {"content": "a", "chat_template": "x"}, "chat_template"),
        ("/detokenize", {"tokens": [72, 100000]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/detokenize", {"tokens": "72"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_input_is_400_naming_the_field(door, path, body, named) -> None:
    response = post(door[2], path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == named and error["type"] == "invalid_request_error", error
    assert post(door[2], path, {**body, "model": "nope"}).status_code in (400, 404)


@FUZZ
@given(
    field=st.sampled_from(["content", "prompt", "messages", "add_special", "with_pieces", "tokens"]),
    value=JSON,
)
def test_fields_never_answer_5xx(shared_base, field, value) -> None:
    for path, base_body in (("/tokenize", {"content": "Hi"}), ("/detokenize", {"tokens": [72]})):
        body = {**base_body, field: value}
        check(post(shared_base, path, body), body)
