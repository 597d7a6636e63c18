"""The issue-23 fields on the packaged SmolLM2-135M-Instruct through the HTTP door with the official
``openai`` client (slow): a json_schema answer validates, logprobs' greedy top-1 is the token and
the tokens spell the text (byte-level BPE: bytes are exact), n=2 computes the prompt once, and a
named tool call validates."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.service.conftest import real_model_services

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_the_fields_on_the_real_model() -> None:
    with real_model_services(max_sessions=8) as (loaded, deps, prefix):
        http = prefix.server.start_http("127.0.0.1", 0, model_name="smollm2")
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0, timeout=300
        )
        question = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
        fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
        answer = client.chat.completions.create(
            model="smollm2", messages=question, response_format=fmt, max_tokens=60, temperature=0
        )
        value = json.loads(answer.choices[0].message.content)
        jsonschema.validate(value, SCHEMA)
        assert "Paris" in value["city"]

        lp = client.chat.completions.create(
            model="smollm2", messages=question, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
        )
        content = lp.choices[0].logprobs.content
        assert all(e.token == e.top_logprobs[0].token for e in content)  # greedy: the top-1
        assert b"".join(bytes(e.bytes) for e in content).decode() == lp.choices[0].message.content

        before = deps.runner.metrics().prefill_positions
        two = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Tell me a fun fact."}],
            n=2,
            max_tokens=8,
            seed=1,
        )
        computed = two.usage.prompt_tokens - two.usage.prompt_tokens_details.cached_tokens
        assert deps.runner.metrics().prefill_positions - before == computed + 1  # + choice 1's replayed token
        assert [c.index for c in two.choices] == [0, 1]

        tool = {"type": "function", "function": {"name": "locate", "parameters": SCHEMA}}
        call = client.chat.completions.create(
            model="smollm2",
            messages=question,
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "locate"}},
            max_tokens=60,
            temperature=0,
        )
        assert call.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.choices[0].message.tool_calls[0].function.arguments), SCHEMA)
