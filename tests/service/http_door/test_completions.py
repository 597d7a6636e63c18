"""The HTTP door's completions (text, token ids, streamed) and its models and health routes."""

from __future__ import annotations

import httpx

from tests.service.http_door.calls import MODEL, sdk


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


def test_models_and_health(shared_base) -> None:
    assert [m.id for m in sdk(shared_base).models.list()] == [MODEL]
    assert httpx.get(shared_base + "/health").json() == {"status": "ok"}
