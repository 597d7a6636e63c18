"""Clone at k, then a suffix == a cold run of tokens[:k] + suffix, through the Runner (tiny model).

Layers "FRFR" with window 4, both cache kinds. Greedy tokens must be equal and the logits behind
every prediction allclose (the executor keeps them; a recording subclass collects them). Clones are
taken after a finished generation, from a callback in the middle of a chunked prefill, and across
ring wraps (prompt far longer than window + max_write). Also: the prompt-lookup executor equals
plain greedy, and a prepared-embeddings prefill of model.embed(tokens) equals the token prefill.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.api.config import GenConfig
from engine_service.executors.embeddings import EmbeddingsExecutor
from engine_service.executors.module import ModuleExecutor
from engine_service.executors.prepared_input import EmbeddingsInput
from engine_service.executors.prompt_lookup import PromptLookupExecutor
from engine_service.runtime.runner import Runner

KINDS = ("batched-sequence", "batched-cell")
PROMPT = [17, 4, 99, 23, 56, 8, 71, 30, 12, 64, 5, 90, 33, 47, 2, 81, 26, 110, 9, 61, 77, 14]
SUFFIX = [40, 41, 42]


def recording(cls):
    class Recording(cls):
        """Keeps the logits behind the last token of every output, in order."""

        def execute(self, batch):
            outs = super().execute(batch)
            self.log.extend(np.array(o.logits) for o in outs if o.tokens)
            return outs

    return Recording


@pytest.fixture(params=["float32", "q8_0"])
def model(tiny_model, request):
    """float32, and the compiled kernels' q8_0 (MLX ops without them): warm must equal cold on both."""
    return tiny_model("FRFR", window=4, tie_embeddings=False, weights_dtype=request.param)


@pytest.fixture
def engine(model, request):
    """Factory: (runner, executor) with a recording executor; every runner is shut down at the end."""
    runners = []

    def make(kind: str, cls=ModuleExecutor, prefill_chunk: int = 4, **kw):
        kw.setdefault("kv_dtype", "float32")  # warm vs cold at float32 tolerances unless a test asks
        ex = recording(cls).create(
            model,
            kind,
            max_sessions=6,
            max_session_tokens=128,
            prefill_chunk=prefill_chunk,
            keep_logits=True,
            **kw,
        )
        ex.log = []
        runner = Runner(ex, max_decode_sequences=4)
        runners.append(runner)
        return runner, ex

    yield make
    for runner in runners:
        runner.shutdown()


def generate(ex, session, tokens, n: int, **config):
    """(tokens, logits rows) of one generation, alone on the runner."""
    ex.log.clear()
    result = session.generate_async(tokens, GenConfig(max_new_tokens=n, **config)).wait(timeout=60)
    assert result.error is None, result.error
    return list(result.tokens), list(ex.log)


def cold(engine, kind, tokens, n, cls=ModuleExecutor):
    runner, ex = engine(kind, cls)
    with runner.open_session() as s:
        return generate(ex, s, tokens, n)


def assert_same(got, want) -> None:
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1])
    np.testing.assert_allclose(np.stack(got[1]), np.stack(want[1]), atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [0, 3, 9, len(PROMPT)])
def test_clone_of_a_finished_prompt_equals_cold(engine, kind, k) -> None:
    runner, ex = engine(kind, prefill_chunk=32)  # max_write 32: every boundary of the prompt survives
    src = runner.open_session()
    src_out = generate(ex, src, PROMPT, 1)  # the prompt is committed, one pending token
    child = src.clone_async(k).result(timeout=30)
    assert child is not None and child.position == k
    got = generate(ex, child, SUFFIX, 6)
    want = cold(engine, kind, PROMPT[:k] + SUFFIX, 6)
    assert_same(got, want)
    # the source is unaffected: it continues exactly like an uninterrupted run
    cont = generate(ex, src, [src_out[0][-1]], 4)
    full = cold(engine, kind, PROMPT, 5)
    assert [src_out[0][-1], *cont[0][:-1]] == full[0][:4]
    child.close()


@pytest.mark.parametrize("kind", KINDS)
def test_clones_from_prefill_callbacks_across_ring_wraps(engine, kind) -> None:
    runner, ex = engine(kind, prefill_chunk=4)  # window 4, max_write 4: the ring wraps every few chunks
    src = runner.open_session()
    futures = {}

    def observer(update) -> None:
        if update.breakpoint is not None:
            futures[update.breakpoint] = src.clone_async(update.breakpoint)  # never wait in a callback

    breakpoints = (5, 13, 18)
    src.generate_async(
        PROMPT, GenConfig(max_new_tokens=8, prefill_chunk=4, prefill_breakpoints=breakpoints), observer
    ).wait(timeout=60)
    assert sorted(futures) == list(breakpoints)
    for k, future in sorted(futures.items()):
        child = future.result(timeout=30)
        assert child is not None and child.position == k
        got = generate(ex, child, SUFFIX, 5)
        child.close()
        want = cold(engine, kind, PROMPT[:k] + SUFFIX, 5)
        assert_same(got, want)
    # a clone at an early prompt boundary after decode overwrote the ring is refused, not wrong
    if kind == "batched-sequence":
        assert src.clone_async(5).result(timeout=30) is None


@pytest.mark.parametrize("kind", KINDS)
def test_the_comparison_can_fail(engine, kind) -> None:
    """Negative control: a clone one position short does not match the cold run of the full prefix."""
    runner, ex = engine(kind, prefill_chunk=32)
    src = runner.open_session()
    generate(ex, src, PROMPT, 1)
    child = src.clone_async(8).result(timeout=30)
    got = generate(ex, child, SUFFIX, 4)
    wrong = cold(engine, kind, PROMPT[:9] + SUFFIX, 4)
    assert not np.allclose(np.stack(got[1]), np.stack(wrong[1]), atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_lookup_equals_plain_greedy(engine, kind) -> None:
    repetitive = PROMPT[:8] * 3
    spec_runner, spec = engine(kind, PromptLookupExecutor, prefill_chunk=8, num_drafts=4, ngram_min=1)
    with spec_runner.open_session() as s:
        got = generate(spec, s, repetitive, 24)
    want = cold(engine, kind, repetitive, 24)
    assert got[0] == want[0]
    assert spec.drafted > 0


@pytest.mark.parametrize("kind", KINDS)
def test_prepared_embeddings_prefill_equals_token_prefill(engine, model, kind) -> None:
    runner, ex = engine(kind, EmbeddingsExecutor, prefill_chunk=4)
    prepared = EmbeddingsInput(model.embed(mx.array(PROMPT, dtype=mx.int32)))
    with runner.open_session() as s:
        got = generate(ex, s, prepared, 6)
        assert s.position == len(PROMPT) + 5
    assert_same(got, cold(engine, kind, PROMPT, 6))


@pytest.mark.slow
def test_real_model_prompt_lookup_equals_plain_greedy_and_clone_equals_cold() -> None:
    """On SmolLM2: speculative greedy == plain greedy on a quoting task; a clone + suffix == cold."""
    from engine_service.executors.base import ExecInput
    from engine_service.model.loading.loader import load_model

    loaded = load_model()
    text = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps again."
    prompt = loaded.tokenizer.encode(loaded.chat.format([{"role": "user", "content": text}]))

    def decode(ex, sid, first, n):
        toks = list(first)
        while len(toks) < n:
            toks.extend(ex.execute([ExecInput(sid, ex.position(sid), tokens=(toks[-1],))])[0].tokens)
        return toks[:n]

    kw = dict(max_sessions=3, max_session_tokens=256, prefill_chunk=64, keep_logits=True)
    plain = ModuleExecutor.create(loaded, **kw)
    spec = PromptLookupExecutor.create(loaded, num_drafts=4, **kw)
    outs, sids = {}, {}
    for name, ex in (("plain", plain), ("spec", spec)):
        sid = sids[name] = ex.open_session()
        outs[name] = decode(ex, sid, ex.execute([ExecInput(sid, 0, tokens=tuple(prompt))])[0].tokens, 24)
    assert outs["spec"] == outs["plain"]
    assert spec.accepted > 0  # the quoting task really exercised accepted drafts

    # clone the plain session's prompt at k, append a suffix: equals a cold prefill of prompt[:k] + suffix
    k, suffix = len(prompt) - 5, loaded.tokenizer.encode(" Sure")
    child = plain.clone(sids["plain"], k)
    warm = plain.execute([ExecInput(child, k, tokens=tuple(suffix))])[0]
    fresh = plain.open_session()
    cold = plain.execute([ExecInput(fresh, 0, tokens=tuple(prompt[:k] + suffix))])[0]
    assert warm.tokens == cold.tokens
    np.testing.assert_allclose(np.array(warm.logits), np.array(cold.logits), atol=1e-3)
