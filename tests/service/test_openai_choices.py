"""``n`` choices through the HTTP door with the official ``openai`` client, over real engine and prefix
servers: the prompt is computed once (the engine prefills it once; the other choices clone its
snapshot), each choice is the one a single request with ``seed + index`` gives, usage counts the
prompt once, and streams carry each choice's ``index``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.service.openai_door import MODEL, Door, openai_door

QUESTION = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def servers() -> Iterator[Door]:
    with openai_door(max_session_tokens=512, max_sessions=16) as door:
        yield door


def lookups(door: Door) -> tuple[int, int]:
    """The prefix cache's (misses, hits) counters."""
    cache = door.prefix.server.deps.stats().cache  # the one engine's gateway
    return cache.misses, cache.hits


def prefilled(engine) -> int:
    return engine.runner.metrics().prefill_positions


def test_n_choices_compute_the_prompt_once_and_match_single_requests(servers) -> None:
    engine, client = servers.engine, servers.client
    messages = [{"role": "user", "content": "Hi there"}]
    before, stats = prefilled(engine), lookups(servers)
    many = client.chat.completions.create(
        model=MODEL, messages=messages, n=4, max_tokens=12, temperature=1.0, seed=100
    )
    prompt = many.usage.prompt_tokens
    # the prompt's positions once, plus one replayed position per further choice (its last token)
    assert prefilled(engine) - before == prompt + 3
    # one request, one lookup counted (choice 0's miss); choices 1-3 hit without counting again
    assert tuple(a - b for a, b in zip(lookups(servers), stats, strict=True)) == (1, 0)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    texts = {c.index: c.message.content for c in many.choices}
    assert len(set(texts.values())) > 1  # own samplers, not four copies
    completion = 0
    for index in range(4):
        one = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=100 + index
        )
        assert one.choices[0].message.content == texts[index]
        assert one.usage.prompt_tokens == prompt
        completion += one.usage.completion_tokens
    assert many.usage.completion_tokens == completion
    assert many.usage.total_tokens == prompt + completion


def test_streamed_choices_carry_their_index(servers) -> None:
    client = servers.client
    request = dict(model=MODEL, messages=QUESTION, n=3, max_tokens=10, temperature=1.0, seed=7)
    whole = client.chat.completions.create(**request)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert set(finishes) == {0, 1, 2}
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_completions_take_n_too(servers) -> None:
    client = servers.client
    answer = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, max_tokens=6, seed=3)
    assert [c.index for c in answer.choices] == [0, 1]
    # one token per character, plus the end-of-sequence token a "stop" choice returned
    assert answer.usage.completion_tokens == sum(
        len(c.text) + (c.finish_reason == "stop") for c in answer.choices
    )
