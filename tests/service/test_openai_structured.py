"""``response_format`` (json_object, json_schema) through the HTTP door with the official ``openai``
client, and ``GenerationConfig.json_schema`` on the engine's gRPC API, over real servers (tiny random
model, one token per character): whatever the model would say, the output parses and validates
(jsonschema); the unconstrained control does not; an unsupported schema feature is a 400 naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from clients.engine_client import EngineClient
from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidArgument
from tests.service.openai_door import MODEL, Door, openai_door

QUESTION = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "member", "role"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def servers() -> Iterator[Door]:
    with openai_door(max_session_tokens=1024) as door:
        yield door


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_output_always_validates(servers, seed) -> None:
    client = servers.client
    request = dict(model=MODEL, messages=QUESTION, max_tokens=300, temperature=1.0, seed=seed)
    answer = client.chat.completions.create(**request, response_format=FORMAT)
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**request, response_format=FORMAT, stream=True)
        if c.choices
    )
    assert streamed == answer.choices[0].message.content
    # negative control: the same request without the format is not such JSON
    free = client.chat.completions.create(**request).choices[0].message.content
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free), SCHEMA)


def test_json_object_and_n_choices(servers) -> None:
    client = servers.client
    answer = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=400,
        temperature=0.7,
        seed=5,
        n=2,
        response_format={"type": "json_object"},
    )
    for choice in answer.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # out of tokens inside an object: still a prefix of one
            assert choice.message.content.startswith("{")


def test_unsupported_schema_features_are_400_naming_them(servers) -> None:
    client = servers.client
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, response_format=bad)
    assert info.value.body["param"] == "response_format" and "if" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            response_format={"type": "json_schema", "json_schema": {"schema": 3}},
        )
    assert info.value.body["param"] == "response_format.json_schema.schema"


def test_the_grpc_api_takes_a_json_schema(servers) -> None:
    engine = servers.engine
    client = EngineClient(engine.address)
    config = GenConfig(max_new_tokens=300, temperature=1.0, seed=9, json_schema=json.dumps(SCHEMA))
    out = client.generate(text="Person:", add_special_tokens=True, config=config).collect()
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.done.finish_reason == "stop"
    with pytest.raises(InvalidArgument, match="if"):
        client.generate(text="x", config=GenConfig(json_schema=json.dumps({"if": {}}))).collect()
