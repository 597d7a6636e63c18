"""Bad input on the ``/v1/responses`` routes: 4xx in OpenAI's error shape naming the field, nothing left
open in the engine; another owner's (or another ``cache_salt``'s) response is a 404 exactly like a
missing one; every JSON value in every request field answers without a 5xx (hypothesis)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service.helpers import wait_for
from tests.service.http_door.calls import MODEL, engine_idle, post
from tests.service.test_http_auth import Tokens
from tests.service.test_http_fuzz import JSON

BODY = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
FIELDS = [
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "max_output_tokens", "temperature", "top_p", "seed", "metadata", "user", "store",
    "previous_response_id", "stream", "stream_options", "cache_salt", "background", "include",
    "reasoning", "truncation", "conversation", "prompt", "service_tier", "top_logprobs", "max_tool_calls",
]  # fmt: skip
BAD = [
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"unheard_of": 1}, "unheard_of"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "extra": 1}]}, "tools[0].extra"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"max_output_tokens": "10"}, "max_output_tokens"),
    ({"store": "yes"}, "store"),
    ({"temperature": 3}, "temperature"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "param"), BAD)
def test_bad_fields_are_a_400_naming_them(shared_base, change, param) -> None:
    response = post(shared_base, "/v1/responses", {**BODY, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_unknown_ids_and_bad_queries(door) -> None:
    engine, prefix, base = door
    missing = post(base, "/v1/responses", {**BODY, "previous_response_id": "resp_nope"})
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": "Response with id 'resp_nope' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": None,
    }
    for method in ("GET", "DELETE"):
        assert httpx.request(method, base + "/v1/responses/resp_nope").status_code == 404
    assert httpx.get(base + "/v1/responses/resp_nope/input_items").status_code == 404
    created = post(base, "/v1/responses", BODY).json()
    for query, param in (
        ("limit=0", "limit"),
        ("limit=x", "limit"),
        ("order=up", "order"),
        ("after=zz", "after"),
    ):
        bad = httpx.get(f"{base}/v1/responses/{created['id']}/input_items?{query}")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    assert httpx.put(base + "/v1/responses").status_code == 405
    assert wait_for(lambda: engine_idle(engine, held=len(prefix.cache)), timeout=10)


def test_another_owners_response_is_missing(engine_factory, prefix_factory) -> None:
    engine = engine_factory(max_session_tokens=1024)
    prefix = prefix_factory(engine.address)
    tokens = Tokens({"alice-token-0123456789": "alice", "bob-token-0123456789ab": "bob"})
    port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL, auth=tokens)
    base = f"http://127.0.0.1:{port}"
    alice = {"authorization": "Bearer alice-token-0123456789"}
    bob = {"authorization": "Bearer bob-token-0123456789ab"}
    mine = httpx.post(base + "/v1/responses", json=BODY, headers=alice).json()["id"]
    salted = httpx.post(base + "/v1/responses", json={**BODY, "cache_salt": "s"}, headers=alice).json()["id"]
    missing = httpx.get(base + "/v1/responses/resp_nope", headers=alice).json()
    for rid, who, query in ((mine, bob, ""), (salted, alice, ""), (mine, alice, "?cache_salt=s")):
        for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items")):
            answer = httpx.request(method, f"{base}/v1/responses/{rid}{path}{query}", headers=who)
            assert answer.status_code == 404
            assert answer.json()["error"]["message"] == missing["error"]["message"].replace("resp_nope", rid)
    chained = httpx.post(base + "/v1/responses", json={**BODY, "previous_response_id": mine}, headers=bob)
    assert chained.status_code == 404 and chained.json()["error"]["param"] == "previous_response_id"
    assert httpx.get(f"{base}/v1/responses/{mine}", headers=alice).status_code == 200
    assert httpx.get(f"{base}/v1/responses/{salted}?cache_salt=s", headers=alice).status_code == 200
    assert httpx.get(f"{base}/v1/responses/{mine}").status_code == 401
    assert wait_for(lambda: engine_idle(engine, held=len(prefix.cache)), timeout=10)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
ITEM = st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "x"])},
    optional={
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | JSON,
        "content": JSON,
        "call_id": JSON,
        "name": JSON,
        "arguments": st.sampled_from(["{}", '{"a": 1}', "[", "1"]) | JSON,
        "output": JSON,
        "id": JSON,
    },
)


@FUZZ
@given(field=st.sampled_from(FIELDS), value=JSON)
def test_response_fields_never_answer_5xx(shared_base, field, value) -> None:
    body = {**BODY, field: value}
    response = post(shared_base, "/v1/responses", body)
    assert response.status_code < 500, (response.status_code, response.text, body)


@FUZZ
@given(items=st.lists(ITEM, max_size=4), stream=st.booleans())
def test_input_items_never_answer_5xx(shared_base, items, stream) -> None:
    body = {**BODY, "input": items, "stream": stream}
    response = post(shared_base, "/v1/responses", body)
    assert response.status_code < 500, (response.status_code, response.text, body)
    if stream and response.status_code == 200:
        assert '"type": "error"' not in response.text, response.text


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_leaves_no_engine_session(door, stream) -> None:
    engine, prefix, base = door
    body = {**BODY, "max_output_tokens": 900, "stream": stream}
    decoded_before = engine.runner.metrics().tokens_decoded
    with httpx.Client(timeout=httpx.Timeout(30, read=None if stream else 0.3)) as http:
        if stream:
            with http.stream("POST", base + "/v1/responses", json=body) as s:
                assert next(line for line in s.iter_lines() if "output_text.delta" in line)
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(base + "/v1/responses", json=body)
    assert wait_for(lambda: engine_idle(engine, held=len(prefix.cache)), timeout=10)
    assert engine.runner.metrics().tokens_decoded - decoded_before < 900  # ended, not run out
