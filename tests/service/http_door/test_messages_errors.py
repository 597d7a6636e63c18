"""Bad input to the Messages API: 4xx in Anthropic's error shape naming the field (unknown and
unimplemented fields, wrong types, breakpoint problems, bad keys), never a 5xx over fuzzed bodies, and
no engine session left behind."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_service.api.errors import InvalidArgument
from prefix_service.gateway.generation_start import check_breakpoints
from tests.service.conftest import start_engine, start_prefix
from tests.service.helpers import wait_for
from tests.service.http_door.calls import MODEL, engine_idle
from tests.service.http_door.messages_calls import claude
from tests.service.test_http_auth import TOKEN, Tokens
from tests.service.test_http_fuzz import JSON

USER = [{"role": "user", "content": "Hi"}]
BODY = {"model": MODEL, "max_tokens": 2, "messages": USER}
MARK = {"type": "ephemeral"}
FIELDS = [
    "model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
    "metadata", "tools", "tool_choice", "cache_control", "thinking", "service_tier",
]  # fmt: skip


@pytest.fixture(scope="module")
def served() -> Iterator[tuple]:
    engine = start_engine(max_session_tokens=256, max_sessions=8)
    prefix = start_prefix(engine.address)
    port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL)
    yield engine, prefix, f"http://127.0.0.1:{port}"
    prefix.stop(0)
    engine.stop(0)


def post(base: str, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body)
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(base + path, content=content, headers=headers, timeout=60)


def refused(response: httpx.Response, status: int = 400) -> str:
    """The error message of an Anthropic-shaped refusal with ``status``."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
    assert body["error"]["type"] == kinds[status]
    return body["error"]["message"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"container": "c"}, "container"),
        ({"mcp_servers": []}, "mcp_servers"),
        ({"service_tier": "auto"}, "service_tier"),
        ({"seed": 1}, "seed"),
        ({"max_tokens": "2"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"stream": "yes"}, "stream"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
        ({"messages": [*USER, {"role": "assistant", "content": "prefill"}]}, "messages[1].role"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, "messages[0].content[0].type"),
        ({"system": [{"type": "text", "text": "s", "citations": []}]}, "system[0].citations"),
        ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "persistent"}}]}, "system[0].cache_control.type"),
        ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}, "system[0].cache_control.ttl"),
        ({"system": [{"type": "text", "text": f"s{i}", "cache_control": MARK} for i in range(5)]}, "system[4]"),
        ({"tools": [{"name": "f", "input_schema": {}, "type": "web_search_20250305"}]}, "tools[0].type"),
        ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].name"),
        ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"stop_sequences": [""]}, "stop_sequences[0]"),
        ({"metadata": {"user_id": "u", "extra": 1}}, "metadata.extra"),
    ],
)  # fmt: skip
def test_bad_fields_are_400_naming_them(served, change, named) -> None:
    message = refused(post(served[2], "/v1/messages", {**BODY, **change}))
    assert message.startswith(named), message


def test_missing_max_tokens_unknown_models_and_bad_json(served) -> None:
    base = served[2]
    assert refused(post(base, "/v1/messages", {"model": MODEL, "messages": USER})).startswith("max_tokens")
    assert "nope" in refused(post(base, "/v1/messages", {**BODY, "model": "nope"}), 404)
    assert "nope" in refused(
        post(base, "/v1/messages/count_tokens", {"model": "nope", "messages": USER}), 404
    )
    assert "JSON" in refused(post(base, "/v1/messages", b"{"))
    assert "object" in refused(post(base, "/v1/messages", b"[1]"))
    # count_tokens has no max_tokens (a field of the generation only)
    assert refused(post(base, "/v1/messages/count_tokens", BODY)).startswith("max_tokens")


def test_breakpoints_outside_the_prompt_are_refused() -> None:
    """The gateway's check (the door's breakpoints come from the prompt's own tokenization)."""
    check_breakpoints((1, 5), 5)
    for bad in ((0,), (6,), (3, -1)):
        with pytest.raises(InvalidArgument, match="breakpoints"):
            check_breakpoints(bad, 5)


def test_keys_map_to_owners(engine_factory, prefix_factory) -> None:
    """x-api-key (Anthropic's header) or a bearer token, from the door's token table; 401 otherwise."""
    engine = engine_factory()
    prefix = prefix_factory(engine.address)
    port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL, auth=Tokens({TOKEN: "alice"}))
    base = f"http://127.0.0.1:{port}"
    for headers in ({}, {"x-api-key": "wrong-token-0123456789"}, {"x-api-key": "short"}):
        refused(post(base, "/v1/messages", BODY, headers=headers), 401)
    refused(post(base, "/v1/messages/count_tokens", {"model": MODEL, "messages": USER}), 401)
    with pytest.raises(anthropic.AuthenticationError):
        claude(base, "wrong-token-0123456789").messages.create(model=MODEL, max_tokens=2, messages=USER)
    answer = claude(base, TOKEN).messages.create(model=MODEL, max_tokens=2, messages=USER)
    assert answer.usage.output_tokens == 2
    bearer = post(base, "/v1/messages", BODY, headers={"authorization": f"Bearer {TOKEN}"})
    assert bearer.status_code == 200 and bearer.json()["usage"]["output_tokens"] == 2


FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "image"])},
    optional={"text": JSON, "cache_control": JSON, "id": JSON, "name": JSON, "input": JSON, "content": JSON},
)


def check(response: httpx.Response, body: dict) -> None:
    assert response.status_code < 500, (response.status_code, response.text, body)
    if response.status_code >= 400:
        assert response.json()["error"]["message"], body


@FUZZ
@given(field=st.sampled_from(FIELDS), value=JSON, stream=st.booleans())
def test_fields_never_answer_5xx(served, field, value, stream) -> None:
    body = {**BODY, "stream": stream, field: value}
    check(post(served[2], "/v1/messages", body), body)
    check(
        post(served[2], "/v1/messages/count_tokens", {"model": MODEL, "messages": USER, field: value}), body
    )


@FUZZ
@given(blocks=st.lists(BLOCK, min_size=1, max_size=3), role=st.sampled_from(["user", "assistant"]))
def test_content_blocks_never_answer_5xx(served, blocks, role) -> None:
    body = {**BODY, "messages": [{"role": role, "content": blocks}, *USER]}
    check(post(served[2], "/v1/messages", body), body)


def test_nothing_is_left_in_the_engine(served) -> None:
    """After the fuzzing (this module's tests run in order): only the stored snapshots remain."""
    engine, prefix, base = served
    post(
        base, "/v1/messages", {**BODY, "system": [{"type": "text", "text": "S" * 40, "cache_control": MARK}]}
    )
    assert wait_for(lambda: engine_idle(engine, held=len(prefix.server.gateway)), timeout=10)
    assert json.loads(post(base, "/v1/messages/count_tokens", {"model": MODEL, "messages": USER}).text)[
        "input_tokens"
    ]
