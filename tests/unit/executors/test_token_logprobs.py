"""Log probabilities through the Runner over a real ModuleExecutor, against a cold forward.

The reference is one forward of the whole sequence (prompt + generated tokens) over the naive
reference cache (``tests/model/reference_cache.py``), its rows' log-softmax in float64: each generated
token's reported value must be that row's value for the token, its top-k those of that row.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.api.config import GenConfig
from engine_service.executors.module import ModuleExecutor
from engine_service.runtime.runner import Runner
from tests.model.reference_cache import ReferenceCache, run

PROMPT = [5, 17, 42, 9, 88, 3, 61]
TOL = 2e-4  # float32 logits, float64 reference


def cold_log_softmax(model, tokens: list[int]) -> np.ndarray:
    """float64 [len(tokens), vocab]: row i is the log-softmax behind token i + 1."""
    cache = ReferenceCache(model.config.layers)
    rows = np.array(run(model, cache, [(cache.seq_new(), 0, tokens)], all_rows=True)[0], dtype=np.float64)
    top = rows.max(-1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(-1, keepdims=True))


def generate(runner: Runner, config: GenConfig, prompt=PROMPT):
    updates = []
    with runner.open_session() as session:
        result = session.generate_async(list(prompt), config, updates.append).wait(60)
    logprobs = [lp for u in updates for lp in u.logprobs]
    return list(result.tokens), logprobs


@pytest.fixture
def model(tiny_model):
    return tiny_model("FFFF")


@pytest.fixture
def runner(model):
    r = Runner(ModuleExecutor.create(model, max_sessions=4, max_session_tokens=128, kv_dtype="float32"))
    yield r
    r.shutdown(10)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_the_cold_forward_log_softmax_before_temperature(model, runner, temperature) -> None:
    config = GenConfig(max_new_tokens=10, temperature=temperature, seed=7, top_logprobs=5)
    tokens, logprobs = generate(runner, config)
    assert len(logprobs) == len(tokens) == 10
    ref = cold_log_softmax(model, PROMPT + tokens)[len(PROMPT) - 1 :]
    for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        row = ref[i]
        assert lp.chosen.id == tok
        assert abs(lp.chosen.logprob - row[tok]) < TOL
        assert [e.id for e in lp.top] == list(np.argsort(-row, kind="stable")[:5])
        assert np.allclose([e.logprob for e in lp.top], np.sort(row)[::-1][:5], atol=TOL)
        if temperature == 0.0:
            assert lp.top[0].id == tok  # the greedy pick is the top-1
    if temperature:
        # negative control: the temperature-scaled distribution differs (so the check above can fail)
        scaled = ref / temperature  # log-softmax of logits / T, from the same rows
        scaled = scaled - np.log(np.exp(scaled).sum(-1, keepdims=True))
        gaps = [abs(e.logprob - scaled[i][e.id]) for i, lp in enumerate(logprobs) for e in lp.top]
        assert max(gaps) > 1.0


def test_logprobs_leave_the_tokens_and_the_neighbours_alone(model, runner) -> None:
    plain = GenConfig(max_new_tokens=12, temperature=0.9, seed=3)
    want, none = generate(runner, plain)
    assert none == []  # not asked: nothing reported
    got, logprobs = generate(runner, GenConfig(max_new_tokens=12, temperature=0.9, seed=3, top_logprobs=0))
    assert got == want and len(logprobs) == 12 and all(lp.top == () for lp in logprobs)
    # two sessions in one batch, only one asking: the other's tokens are the ones it gets alone
    other_prompt = [7, 7, 100, 2, 31]
    alone, _ = generate(runner, GenConfig(max_new_tokens=12), other_prompt)
    outs: dict[str, list] = {"a": [], "b": []}
    with runner.open_session() as a, runner.open_session() as b:
        ha = a.generate_async(PROMPT, GenConfig(max_new_tokens=12, top_logprobs=3), outs["a"].append)
        hb = b.generate_async(other_prompt, GenConfig(max_new_tokens=12), outs["b"].append)
        ra, rb = ha.wait(60), hb.wait(60)
    assert list(rb.tokens) == alone and not any(u.logprobs for u in outs["b"])
    assert len([lp for u in outs["a"] for lp in u.logprobs]) == len(ra.tokens)


def test_log_softmax_matches_numpy() -> None:
    from engine_service.executors.token_logprobs import log_softmax

    x = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32) * 8
    want = x - np.log(np.exp(x.astype(np.float64)).sum(-1, keepdims=True))
    assert np.allclose(np.array(log_softmax(mx.array(x))), want, atol=1e-5)
