"""Every JSON value in every field of the HTTP door's request bodies is answered without a 5xx
(property-based, hypothesis): a bad value is a 400 naming the field, a good one a normal answer.

A tiny engine with 256-position sessions behind a prefix service and its HTTP door (real sockets), so a
valid fuzzed request generates at most a few tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service.conftest import start_engine, start_prefix

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
CHAT_FIELDS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n",
    "stream", "stream_options", "user", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
    "top_logprobs", "tools", "tool_choice", "response_format", "cache_salt",
]  # fmt: skip
COMPLETION_FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "echo",
    "logprobs", "best_of", "suffix", "user", "cache_salt",
]  # fmt: skip

# any JSON value, with integers and floats at and past every machine width
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.sampled_from([2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1e30, -1e30, 1e-320, 0.0, -0.0])
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    engine = start_engine(max_session_tokens=256, max_sessions=8)
    prefix = start_prefix(engine.address)
    port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL)
    yield f"http://127.0.0.1:{port}"
    prefix.stop(0)
    engine.stop(0)


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        base + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60
    )


def check(response: httpx.Response, body: dict) -> None:
    assert response.status_code < 500, (response.status_code, response.text, body)
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["message"], body


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(field=st.sampled_from(CHAT_FIELDS), value=JSON)
def test_chat_fields_never_answer_5xx(base, field, value):
    body = {**CHAT, field: value}
    check(post(base, "/v1/chat/completions", body), body)


@FUZZ
@given(field=st.sampled_from(COMPLETION_FIELDS), value=JSON)
def test_completion_fields_never_answer_5xx(base, field, value):
    body = {**COMPLETION, field: value}
    check(post(base, "/v1/completions", body), body)


@FUZZ
@given(
    messages=st.lists(
        st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]), JSON), max_size=3
    )
)
def test_message_lists_never_answer_5xx(base, messages):
    body = {**CHAT, "messages": messages}
    check(post(base, "/v1/chat/completions", body), body)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 9223372036854775808),
        ("max_tokens", 1e30),
        ("max_completion_tokens", 2**64),
        ("seed", 2**64),
        ("max_tokens", 2**31),
        ("n", 2**40),
    ],
)
def test_out_of_range_numbers_are_400_naming_the_field(base, field, value):
    """The reported cases: values past int64 (or past what a session can hold) are the caller's error."""
    r = post(base, "/v1/chat/completions", {**CHAT, field: value})
    assert r.status_code == 400, r.text
    assert field in json.dumps(r.json()["error"]), r.text
