"""JSON-schema constrained decoding through the Runner over a real ModuleExecutor (tiny model, the
tests' one-character tokenizer): the output always parses and validates (jsonschema), greedy and
sampled, batched beside an unconstrained session; an unsupported schema names the feature."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidJsonSchema
from engine_service.executors.grammar import compile_json_schema, schema_problem, with_grammar
from engine_service.executors.module import ModuleExecutor
from engine_service.model.text.tokenizer import Tokenizer
from engine_service.runtime.runner import Runner

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}


def char_tokenizer() -> Tokenizer:
    """ids 3..127 are the ASCII characters with those codes; 0 / 1 / 2 are <unk> / <bos> / <eos>."""
    specials = {"<unk>": 0, "<bos>": 1, "<eos>": 2}
    backend = HFTokenizer(
        models.WordLevel(vocab=specials | {chr(i): i for i in range(3, 128)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(specials))
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=(EOS,), add_bos=True)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return char_tokenizer()


@pytest.fixture
def runner(tiny_model):
    r = Runner(
        ModuleExecutor.create(
            tiny_model("FRFR"), cache_kind="batched-cell", max_sessions=4, max_session_tokens=256
        )
    )
    yield r
    r.shutdown(10)


def text_of(tokenizer, tokens) -> str:
    assert tokens[-1] == EOS, "the generation ends at end-of-sequence once the JSON is complete"
    return tokenizer.decode(tokens[:-1])


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (1.0, 1), (1.0, 2), (1.5, 3)])
def test_output_parses_and_validates(runner, tokenizer, temperature, seed) -> None:
    prompt = tokenizer.encode("Give me JSON:", add_special_tokens=True)
    config = with_grammar(
        GenConfig(
            max_new_tokens=200,
            temperature=temperature,
            seed=seed,
            stop_tokens=(EOS,),
            json_schema=json.dumps(SCHEMA),
        ),
        tokenizer,
    )
    with runner.open_session() as session:
        constrained = session.generate_async(prompt, config).wait(60)
    value = json.loads(text_of(tokenizer, constrained.tokens))
    jsonschema.validate(value, SCHEMA)
    # negative control: the same request unconstrained is not that JSON (the check above can fail)
    plain = GenConfig(
        max_new_tokens=len(constrained.tokens), temperature=temperature, seed=seed, stop_tokens=(EOS,)
    )
    with runner.open_session() as session:
        free = tokenizer.decode(session.generate_async(prompt, plain).wait(60).tokens)
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free), SCHEMA)


def test_a_constrained_session_beside_a_free_one_leaves_it_alone(runner, tokenizer) -> None:
    prompt = tokenizer.encode("abc", add_special_tokens=True)
    free = GenConfig(max_new_tokens=30)
    with runner.open_session() as s:
        alone = s.generate_async(prompt, free).wait(60).tokens
    config = with_grammar(
        GenConfig(max_new_tokens=200, stop_tokens=(EOS,), json_schema=json.dumps({"type": "object"})),
        tokenizer,
    )
    with runner.open_session() as a, runner.open_session() as b:
        ha, hb = a.generate_async(prompt, config), b.generate_async(prompt, free)
        ra, rb = ha.wait(60), hb.wait(60)
    assert rb.tokens == alone
    assert isinstance(json.loads(text_of(tokenizer, ra.tokens)), dict)


def test_unsupported_features_are_named(tokenizer) -> None:
    assert "if" in schema_problem({"type": "object", "if": {"type": "object"}})
    assert "xyz" in schema_problem({"type": "string", "format": "xyz"})
    assert schema_problem(SCHEMA) is None
    with pytest.raises(InvalidJsonSchema, match="if"):  # the typed refusal the HTTP door maps to a field
        compile_json_schema(json.dumps({"if": {}}), tokenizer)
    with pytest.raises(InvalidJsonSchema, match="not JSON"):
        compile_json_schema("{", tokenizer)


def test_an_uncompiled_schema_is_refused(runner) -> None:
    with runner.open_session() as session:
        result = session.generate_async([1, 5], GenConfig(json_schema='{"type": "object"}')).wait(60)
    assert result.finish_reason == "error" and "json_schema" in result.error
