"""``GenConfig.drawn_tokens`` (a resumed generation): a run over the prompt + the first k tokens an
uninterrupted run drew, with ``drawn_tokens = k``, draws the rest of that run exactly -- greedy, seeded
sampling, and a json_schema grammar (which consumed the k tokens) -- on both cache kinds, with the
drawn tokens fed as input or held by the session (a clone). Negative control: without
``drawn_tokens`` a sampled continuation diverges. Bad values name the field."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidArgument
from engine_service.executors.grammar import with_grammar
from engine_service.executors.module import ModuleExecutor
from engine_service.runtime.runner import Runner
from tests.unit.executors.test_grammar import EOS, SCHEMA, char_tokenizer

PROMPT = [5, 17, 42, 9, 88, 3, 61, 7]
N = 24


@pytest.fixture(params=["batched-sequence", "batched-cell"])
def runner(request, tiny_model):
    r = Runner(
        ModuleExecutor.create(
            tiny_model("FRFR"), cache_kind=request.param, max_sessions=4, max_session_tokens=256
        )
    )
    yield r
    r.shutdown(10)


def run(runner: Runner, tokens, config: GenConfig) -> list[int]:
    with runner.open_session() as session:
        return list(session.generate_async(list(tokens), config).wait(60).tokens)


@pytest.mark.parametrize(
    ("temperature", "k"), [(0.0, 5), (4.0, 1), (4.0, 9), (6.0, 23)]
)  # diverse: tiny model
def test_a_resume_draws_the_rest_of_the_uninterrupted_run(runner, temperature, k) -> None:
    config = GenConfig(max_new_tokens=N, temperature=temperature, top_k=40, seed=11)
    whole = run(runner, PROMPT, config)
    assert len(whole) == N
    resumed = run(runner, PROMPT + whole[:k], replace(config, max_new_tokens=N - k, drawn_tokens=k))
    assert resumed == whole[k:]
    if temperature and k < N - 4:  # negative control: the seed alone restarts the draws
        fresh = run(runner, PROMPT + whole[:k], replace(config, max_new_tokens=N - k))
        assert fresh != whole[k:]


def test_drawn_tokens_the_session_already_holds(runner) -> None:
    """The resume reuses a clone holding the prompt and 6 drawn tokens, the input the 7th onward."""
    config = GenConfig(max_new_tokens=N, temperature=4.0, seed=3)
    whole = run(runner, PROMPT, config)
    k = 10
    with runner.open_session() as source:
        source.generate_async(PROMPT + whole[:6], GenConfig(max_new_tokens=1)).wait(60)
        with source.clone_async(len(PROMPT) + 6).result(60) as clone:
            rest = replace(config, max_new_tokens=N - k, drawn_tokens=k)
            assert list(clone.generate_async(whole[6:k], rest).wait(60).tokens) == whole[k:]


def test_a_grammar_resumes_where_it_was(runner) -> None:
    tokenizer = char_tokenizer()
    prompt = tokenizer.encode("JSON:", add_special_tokens=True)
    base = GenConfig(
        max_new_tokens=120, temperature=1.0, seed=5, stop_tokens=(EOS,), json_schema=json.dumps(SCHEMA)
    )
    whole = run(runner, prompt, with_grammar(base, tokenizer))
    assert whole[-1] == EOS
    k = len(whole) // 2
    rest = with_grammar(replace(base, max_new_tokens=120 - k, drawn_tokens=k), tokenizer)
    assert run(runner, prompt + whole[:k], rest) == whole[k:]
    json.loads(tokenizer.decode(whole[:-1]))


def test_bad_drawn_tokens_name_the_field(runner) -> None:
    with pytest.raises(InvalidArgument, match="drawn_tokens"):
        GenConfig(drawn_tokens=-1)
    with runner.open_session() as session:
        bad = GenConfig(max_new_tokens=2, drawn_tokens=len(PROMPT) + 1)
        result = session.generate_async(PROMPT, bad).wait(60)
    assert result.tokens == () and "drawn_tokens = 9 is more than" in (result.error or "")
