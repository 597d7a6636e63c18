"""EmbeddingsExecutor: a prefill of model.embed(tokens) behaves exactly like the token prefill."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.executors.base import ExecInput
from engine_service.executors.embeddings import EmbeddingsExecutor
from engine_service.executors.prepared_input import EmbeddingsInput, PreparedInput, PreparedKind
from tests.unit.executors.helpers import CountingModel, greedy_decode, reference_greedy

KINDS = ("batched-sequence", "batched-cell")
PROMPT = [17, 4, 99, 23, 56, 8, 71, 30, 12, 64, 5]
OTHER = [3, 88, 41, 7, 19]


@pytest.fixture
def model(tiny_model):
    return tiny_model("FRFR", window=4, tie_embeddings=False)


def make(model, kind="batched-sequence", **kw):
    return EmbeddingsExecutor.create(
        model, kind, max_sessions=4, max_session_tokens=128, kv_dtype="float32", keep_logits=True, **kw
    )


def embedded(model, tokens) -> EmbeddingsInput:
    return EmbeddingsInput(model.embed(mx.array(tokens, dtype=mx.int32)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [512, 4])
def test_embedding_prefill_equals_token_prefill(model, kind, chunk) -> None:
    ex = make(model, kind, prefill_chunk=chunk)
    sid = ex.open_session()
    out = ex.execute([ExecInput(sid, 0, prepared=embedded(model, PROMPT))])[0]
    want, want_logits = reference_greedy(model, PROMPT, 6)
    np.testing.assert_allclose(np.array(out.logits), want_logits[0], atol=1e-4)
    assert greedy_decode(ex, sid, out.tokens, 6) == want  # decode feedback stays raw tokens


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_is_one_forward(model, kind) -> None:
    counting = CountingModel(model)
    ex = make(counting, kind)
    a, b = ex.open_session(), ex.open_session()
    outs = ex.execute(
        [ExecInput(a, 0, tokens=tuple(PROMPT)), ExecInput(b, 0, prepared=embedded(model, OTHER))]
    )
    assert counting.calls == [len(PROMPT) + len(OTHER)]
    assert outs[0].tokens[0] == reference_greedy(model, PROMPT, 1)[0][0]
    assert outs[1].tokens[0] == reference_greedy(model, OTHER, 1)[0][0]


def test_chunks_of_a_prepared_input_append(model) -> None:
    ex = make(model)
    sid = ex.open_session()
    whole = embedded(model, PROMPT)
    ex.execute([ExecInput(sid, 0, prepared=whole.chunk(0, 5), want_output=False)])
    out = ex.execute([ExecInput(sid, 5, prepared=whole.chunk(5, whole.size()))])[0]
    assert ex.position(sid) == len(PROMPT)
    assert out.tokens[0] == reference_greedy(model, PROMPT, 1)[0][0]


def test_wrong_embedding_shape_or_kind_fails_only_that_input(model) -> None:
    class Other(PreparedInput):
        KIND = PreparedKind("other")

        def size(self) -> int:
            return 2

        def chunk(self, start, stop):
            return self

    ex = make(model)
    a, b, c = ex.open_session(), ex.open_session(), ex.open_session()
    assert ex.accepts(embedded(model, OTHER)) and not ex.accepts(Other())
    outs = ex.execute(
        [
            ExecInput(a, 0, prepared=EmbeddingsInput(mx.zeros((3, 32)))),
            ExecInput(b, 0, prepared=Other()),
            ExecInput(c, 0, tokens=tuple(OTHER)),
        ]
    )
    assert "hidden" in outs[0].error and "does not accept" in outs[1].error
    assert outs[2].tokens[0] == reference_greedy(model, OTHER, 1)[0][0]
    assert ex.position(a) == ex.position(b) == 0


def test_a_different_embedding_changes_the_output(model) -> None:
    """Negative control: the executor really reads the prepared rows."""
    ex = make(model)
    a, b = ex.open_session(), ex.open_session()
    emb = model.embed(mx.array(PROMPT, dtype=mx.int32))
    outs = ex.execute(
        [ExecInput(a, 0, prepared=EmbeddingsInput(emb)), ExecInput(b, 0, prepared=EmbeddingsInput(emb * 0.5))]
    )
    assert not np.allclose(np.array(outs[0].logits), np.array(outs[1].logits), atol=1e-3)


def test_module_executor_runner_fails_only_the_prepared_generation(model) -> None:
    from engine_service.api.config import GenConfig
    from engine_service.executors.module import ModuleExecutor
    from engine_service.runtime.runner import Runner

    runner = Runner(ModuleExecutor.create(model, max_sessions=4, max_session_tokens=128))
    try:
        a, b = runner.open_session(), runner.open_session()
        bad = a.generate_async(embedded(model, PROMPT), GenConfig(max_new_tokens=3))
        good = b.generate_async(PROMPT, GenConfig(max_new_tokens=3))
        assert bad.wait(timeout=30).finish_reason == "error"
        assert list(good.wait(timeout=30).tokens) == reference_greedy(model, PROMPT, 3)[0]
    finally:
        runner.shutdown()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_embeddings_fail_alone_and_never_reach_a_branch(model, bad) -> None:
    # In the cell pool a branch's view is a slice whose masked cells may hold another session's rows;
    # masking zeroes their weight, but 0 * NaN is NaN, so a non-finite row would leak into the branch.
    ex = make(model, "batched-cell")
    src = ex.open_session()
    first = ex.execute([ExecInput(src, 0, tokens=tuple(PROMPT[:4]))])[0]
    branch = ex.clone(src, 4)
    rows = np.array(model.embed(mx.array([9], dtype=mx.int32)))
    rows[0, 3] = bad
    out = ex.execute([ExecInput(branch, 4, prepared=EmbeddingsInput(mx.array(rows)))])[0]
    assert out.error is not None and "finite" in out.error
    assert ex.position(branch) == 4  # refused before anything was written
    toks = greedy_decode(ex, src, first.tokens, 4)
    assert toks == reference_greedy(model, PROMPT[:4], 4)[0]
    fine = ex.execute([ExecInput(branch, 4, prepared=embedded(model, [9]))])[0]
    assert fine.error is None and fine.tokens[0] == reference_greedy(model, PROMPT[:4] + [9], 1)[0][0]
