"""``logprobs`` through the HTTP door with the official ``openai`` client, over real engine and prefix
servers (tiny model, one token per character): chat (``top_logprobs``) and completions (``logprobs``),
whole and streamed, against the engine's own gRPC answer for the same tokens."""

from __future__ import annotations

import math
from collections.abc import Iterator

import openai
import pytest

from clients.engine_client import EngineClient
from engine_service.api.config import GenConfig
from tests.service.openai_door import MODEL, Door, openai_door

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def servers() -> Iterator[Door]:
    with openai_door(max_session_tokens=1024) as door:
        yield door


@pytest.fixture(scope="module")
def client(servers) -> openai.OpenAI:
    return servers.client


def test_completion_logprobs_are_the_engines_and_greedy_picks_the_top_one(servers, client) -> None:
    engine = servers.engine
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    choice = answer.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and value <= 0
        best = max(top, key=top.get)
        assert best == token and math.isclose(top[best], value, abs_tol=1e-6)  # greedy: the top-1
        assert list(top.values()) == sorted(top.values(), reverse=True)
    # the engine's gRPC answer for the same request: the same tokens and values
    wire = (
        EngineClient(engine.address)
        .generate(
            text=PROMPT,
            add_special_tokens=True,
            config=GenConfig(max_new_tokens=8, temperature=0, top_logprobs=3),
        )
        .collect()
        .logprobs
    )
    assert [e.chosen.text for e in wire] == lp.tokens
    assert [e.chosen.logprob for e in wire] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert [{t.text: t.logprob for t in e.top} for e in wire] == lp.top_logprobs


def test_chat_logprobs_whole_and_streamed_agree(client) -> None:
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=10,
        temperature=0.8,
        seed=11,
        logprobs=True,
        top_logprobs=4,
    )
    whole = client.chat.completions.create(**request)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens - (whole.choices[0].finish_reason == "stop")
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 4 and entry.logprob <= 0
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob <= values[0] + 1e-6
    streamed = []
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed.extend(choice.logprobs.content)
    # the stream reuses the stored prompt: the same tokens, values within float32 rounding
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    # not asked: none reported
    plain = client.chat.completions.create(**{k: v for k, v in request.items() if "logprobs" not in k})
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == whole.choices[0].message.content  # same seed, same tokens


def test_top_logprobs_past_the_bounds_are_refused(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21
        )
    assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", logprobs=6)
    assert info.value.body["param"] == "logprobs"
