"""The HTTP door's refusals: the SDK's exceptions, malformed bodies naming the field, unknown routes
and methods, an engine that is down."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.service.http_door.calls import MODEL, QUESTION, post, sdk


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


def test_engine_down_is_503(door) -> None:
    engine, _, base = door
    engine.stop(0)
    response = post(base, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 2})
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(base + "/health").status_code == 503
