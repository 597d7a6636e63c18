"""Half-precision K/V caches (``--kv_dtype float16 / bfloat16``): the clone-vs-cold contract on both
cache kinds (warm and cold read the same stored values), snapshots and files keep the dtype, a file of
another K/V dtype is refused, deterministic mode stays bitwise, and ``auto`` resolves as documented.
The stored values differ from float32 by their rounding only (the negative control: a float16 run is
not float32's bits, and the gap is small)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidArgument
from engine_service.executors.cache_setup import resolve_kv_dtype
from engine_service.executors.module import ModuleExecutor
from engine_service.model.cpu_kernels import kernels
from engine_service.runtime.runner import Runner
from engine_service.sessions.session_files import load_session, save_session

KINDS = ("batched-sequence", "batched-cell")
HALF = ("float16", "bfloat16")
PROMPT = [17, 4, 99, 23, 56, 8, 71, 30, 12, 64, 5, 90, 33, 47, 2, 81, 26, 110, 9, 61, 77, 14]
SUFFIX = [40, 41, 42]
# Block-quantized weights where the kernels load (what a GGUF model runs): their matmuls give a row the
# same bits in a 22- or a 25-row forward, so the clone's prefix and the cold run's hold the same stored
# K/V. With float32 weights OpenBLAS's sums depend on the row count in the last bits, and a float16 cache
# rounds some of those values to neighbouring halves (one ulp, ~5e-4 in the logits: seen on a Zen 5 EPYC)
WEIGHTS = "q8_0" if kernels() is not None else "float32"


@pytest.fixture
def engine(tiny_model):
    runners = []
    model = tiny_model("FRFR", window=4, tie_embeddings=False, weights_dtype=WEIGHTS)

    def make(kind: str, kv_dtype: str, **kw):
        ex = ModuleExecutor.create(model, kind, max_sessions=6, max_session_tokens=128, kv_dtype=kv_dtype,
                                   prefill_chunk=kw.pop("prefill_chunk", 4), keep_logits=True, **kw)  # fmt: skip
        runner = Runner(ex, max_decode_sequences=4)
        runners.append(runner)
        return runner, ex

    yield make
    for r in runners:
        r.shutdown()


def generate(session, tokens, n):
    logs = []
    result = session.generate_async(tokens, GenConfig(max_new_tokens=n), lambda u: logs.append(u)).wait(60)
    assert result.error is None, result.error
    return list(result.tokens)


def logits_run(ex, runner, tokens, n):
    """(tokens, logits rows) of a cold generation (the executor keeps the logits behind each output)."""
    seen = []
    orig = ex.execute

    def record(batch):
        outs = orig(batch)
        seen.extend(np.array(o.logits) for o in outs if o.tokens)
        return outs

    ex.execute = record
    try:
        with runner.open_session() as s:
            toks = generate(s, tokens, n)
    finally:
        ex.execute = orig
    return toks, seen


def test_auto_and_names_resolve():
    assert resolve_kv_dtype("float32") == mx.float32 and resolve_kv_dtype("bfloat16") == mx.bfloat16
    expect = mx.float16 if kernels() is not None else mx.float32
    assert resolve_kv_dtype("auto") in (expect, mx.float16)
    with pytest.raises(InvalidArgument, match="kv_dtype must be one of auto, float16, bfloat16, float32"):
        resolve_kv_dtype("int8")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kv", HALF)
@pytest.mark.parametrize("k", [3, 9, len(PROMPT)])
def test_a_clone_continues_like_a_cold_run_on_a_half_precision_cache(engine, kind, kv, k):
    runner, ex = engine(kind, kv, prefill_chunk=32)
    assert ex.kv_dtype == getattr(mx, kv)
    src = runner.open_session()
    generate(src, PROMPT, 1)
    child = src.clone_async(k).result(timeout=30)
    assert child is not None and child.position == k
    warm = logits_run_session(ex, child, SUFFIX, 5)
    cold = logits_run(ex, runner, PROMPT[:k] + SUFFIX, 5)
    assert warm[0] == cold[0]
    np.testing.assert_allclose(np.stack(warm[1]), np.stack(cold[1]), atol=1e-4)
    child.close()
    src.close()


def logits_run_session(ex, session, tokens, n):
    seen = []
    orig = ex.execute

    def record(batch):
        outs = orig(batch)
        seen.extend(np.array(o.logits) for o in outs if o.tokens)
        return outs

    ex.execute = record
    try:
        return generate(session, tokens, n), seen
    finally:
        ex.execute = orig


@pytest.mark.parametrize("kind", KINDS)
def test_half_precision_is_rounding_away_from_float32(engine, kind):
    """Negative control: float16 K/V are not float32's bits, and the gap is only their rounding."""
    r32, e32 = engine(kind, "float32")
    r16, e16 = engine(kind, "float16")
    a = np.stack(logits_run(e32, r32, PROMPT, 4)[1])
    b = np.stack(logits_run(e16, r16, PROMPT, 4)[1])
    gap = np.abs(a - b).max()
    assert 0 < gap < 0.05 * np.abs(a).max(), gap


@pytest.mark.parametrize("kind", KINDS)
def test_snapshot_files_keep_the_dtype_and_refuse_another(engine, tmp_path, kind):
    runner, ex = engine(kind, "float16")
    s = runner.open_session()
    generate(s, PROMPT, 1)
    saved = save_session(s, tmp_path)
    assert saved.saved, saved
    runner2, ex2 = engine(kind, "float16")
    back = load_session(runner2, saved.path)
    assert back.loaded, back
    assert (
        logits_run_session(ex2, back.session, SUFFIX, 4)[0] == logits_run(ex2, runner2, PROMPT + SUFFIX, 4)[0]
    )
    runner3, _ = engine(kind, "float32")
    refused = load_session(runner3, saved.path)
    assert not refused.loaded and refused.refusal in ("fingerprint", "geometry", "shape"), refused


def test_deterministic_mode_stays_bitwise_on_float16(tiny_model):
    ext = kernels()
    if ext is None or not hasattr(ext, "causal_attention"):
        pytest.skip("needs the compiled kernels")
    model = tiny_model("FRFR", window=20, weights_dtype="q8_0", tie_embeddings=False)
    model.set_deterministic(True)
    try:
        ex = ModuleExecutor.create(model, "batched-sequence", max_sessions=4, max_session_tokens=256,
                                   kv_dtype="float16", prefill_chunk=7, keep_logits=True)  # fmt: skip
        runner = Runner(ex, max_decode_sequences=2)
        prompt = (PROMPT * 5)[:90]
        src = runner.open_session()
        generate(src, prompt, 1)
        child = src.clone_async(85).result(timeout=30)  # within the ring's floor (90 - max_write 7)
        assert child is not None
        warm = logits_run_session(ex, child, prompt[85:] + SUFFIX, 3)
        cold = logits_run(ex, runner, prompt + SUFFIX, 3)
        assert warm[0] == cold[0]
        assert all(np.array_equal(a, b) for a, b in zip(warm[1][-3:], cold[1][-3:], strict=True))
        runner.shutdown()
    finally:
        model.set_deterministic(False)
