"""The HTTP door's pure pieces: stop strings on text deltas, the error mapping, the served model id."""

from __future__ import annotations

import pytest

from engine_service.api import errors
from prefix_service.http.app import served_model_name
from prefix_service.http.errors import error_body, field_path
from prefix_service.http.stop_strings import StopMatcher


@pytest.mark.parametrize(
    ("stops", "deltas", "emitted", "stopped"),
    [
        (["END"], ["ab", "cE", "N", "Dxyz"], "abc", True),  # across three deltas
        (["END"], ["ab", "cE", "Nx"], "abcENx", False),  # a partial match is released
        (["xx", "b"], ["axxb"], "a", True),  # the earliest match wins
        (["b", "ab"], ["cab"], "c", True),  # ...whichever stop string it is
        ([], ["abc"], "abc", False),
        (["\n\n"], ["line\n", "\nmore"], "line", True),
    ],
)
def test_stop_matcher(stops, deltas, emitted, stopped) -> None:
    matcher = StopMatcher(stops)
    out, done = "", False
    for delta in deltas:
        text, done = matcher.push(delta)
        out += text
        if done:
            break
    if not done:
        out += matcher.flush()
    assert (out, done) == (emitted, stopped)


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (errors.InvalidArgument("x must be > 0"), 400, "invalid_request_error"),
        (errors.ResourceExhausted("no free session"), 429, "rate_limit_error"),
        (errors.Unavailable("engine stopping"), 503, "service_unavailable"),
        (errors.NotFound("unknown handle"), 503, "service_unavailable"),
        (errors.GenerationError("executor failed"), 500, "server_error"),
        (KeyError("secret internals"), 500, "server_error"),
    ],
)
def test_error_mapping(exc, status, kind) -> None:
    code, body = error_body(exc)
    assert (code, body.error.type) == (status, kind)
    assert ("secret" not in body.error.message) and body.error.message


@pytest.mark.parametrize(
    ("engine_model", "served"),
    [
        ("/x/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1"),
        ("/models/llama-mlx/", "llama-mlx"),
        ("tiny-FRFR-seed0", "tiny-FRFR-seed0"),
    ],
)
def test_served_model_name(engine_model, served) -> None:
    assert served_model_name(engine_model) == served


@pytest.mark.parametrize(
    ("loc", "spelled"),
    [
        (("messages", 0, "content"), "messages[0].content"),
        (("messages", 0, "content", "list[TextPart]", 1, "type"), "messages[0].content[1].type"),
        (("stop", "str"), "stop"),
        ((), ""),
    ],
)
def test_field_path(loc, spelled) -> None:
    assert field_path(loc) == spelled


def test_a_conversation_on_a_base_model_is_plain_text() -> None:
    from engine_service.api.prompts import TextPrompt
    from prefix_service.http.convert import served

    chat = TextPrompt(
        "", chat=True, messages=(("system", "S."), ("user", "Hi"), ("assistant", ""), ("user", "Go"))
    )
    assert served(chat, chat_template=True) is chat  # negative control: a chat model renders it
    assert served(chat, chat_template=False) == TextPrompt("S.\n\nHi\n\nGo", add_special_tokens=True)
    text = TextPrompt("as is")
    assert served(text, chat_template=False) is text


def test_the_speculative_field_reaches_the_generation_and_a_bad_value_is_refused() -> None:
    import pydantic

    from prefix_service.http.convert import gateway_request
    from prefix_service.http.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    off = ChatCompletionRequest.model_validate({**body, "speculative": "off"})
    assert gateway_request(off, [1, 2]).config.speculative == "off"
    default = ChatCompletionRequest.model_validate(body)
    assert gateway_request(default, [1, 2]).config.speculative == ""
    with pytest.raises(pydantic.ValidationError) as caught:
        ChatCompletionRequest.model_validate({**body, "speculative": "always"})
    assert field_path(caught.value.errors()[0]["loc"]) == "speculative"
