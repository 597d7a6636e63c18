"""The fused decoder layer (``DecoderLayer.fused``: ``forkline_kernels.fused_qkv`` / ``fused_linear`` around
the attention kernel) against the unfused MLX ops, on tiny block-quantized models of every layer shape
the fused path covers (Llama's pre-norm, Gemma 3's sandwich norms and QK-norm, Qwen2's q/k/v bias,
traditional and default RoPE, float16 K/V), and a cold run against a decode over the cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import engine_service.model.layers as layers
from engine_service.executors.base import ExecInput
from engine_service.executors.module import ModuleExecutor
from engine_service.model.cpu_kernels import kernels
from engine_service.model.random_init import random_model

ext = kernels()
if ext is None or not hasattr(ext, "fused_qkv"):
    pytest.skip("compiled kernels with fused_qkv are not built (scripts/setup.sh)", allow_module_level=True)

MODELS = {
    "llama-q4_1": dict(architecture="llama", weights_dtype="q4_1", rope_traditional=True),
    "llama-q8_0-untied": dict(architecture="llama", weights_dtype="q8_0", tie_embeddings=False),
    "gemma3": dict(architecture="gemma3", weights_dtype="q8_0", head_dim=32, rope_local_theta=1e4),
    "qwen2-bias": dict(architecture="qwen2", weights_dtype="q4_1"),
    "qwen3-qk-norm": dict(architecture="qwen3", weights_dtype="q8_0"),
}
# relative bound on the logits: float32 rounding, and for float16 K/V one half-precision step of a key
# or value (~5e-4 relative) that the two paths round differently
BOUND = {"float32": 2e-5, "float16": 2e-3}
PROMPT = [5, 17, 99, 3, 42, 42, 7, 120, 64, 1, 33, 8, 91, 27, 66, 12, 4, 101, 77, 50]


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return random_model("FRFR", 6, 2, **MODELS[request.param])


def logits(model, fused: bool, kv_dtype: str, chunks: list[int]) -> np.ndarray:
    """The prompt fed in ``chunks``, then 4 greedy decode steps: every output's logits, stacked."""
    old = layers.FUSED_OPS
    layers.FUSED_OPS = fused
    try:
        ex = ModuleExecutor.create(
            model, max_sessions=1, max_session_tokens=64, kv_dtype=kv_dtype, keep_logits=True
        )
        sid = ex.open_session()
        out, at, rows = None, 0, []
        for n in chunks:
            out = ex.execute([ExecInput(sid, at, tokens=tuple(PROMPT[at : at + n]))])[0]
            at += n
            rows.append(np.array(out.logits))
        for _ in range(4):
            out = ex.execute([ExecInput(sid, at, tokens=(out.tokens[-1],))])[0]
            at += 1
            rows.append(np.array(out.logits))
        return np.stack(rows)
    finally:
        layers.FUSED_OPS = old


def test_the_fused_path_is_taken(model):
    # every row count (on AVX2 blocks above kernel_max_rows through the panel GEMM)
    assert all(layer.fuses(n) for layer in model.layers for n in (1, 64, 65, 10_000))
    old = layers.FUSED_OPS
    layers.FUSED_OPS = False
    try:
        assert not model.layers[0].fuses(1)
    finally:
        layers.FUSED_OPS = old


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_fused_equals_unfused(model, kv_dtype):
    want = logits(model, False, kv_dtype, [len(PROMPT)])
    got = logits(model, True, kv_dtype, [len(PROMPT)])
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= BOUND[kv_dtype] * scale, np.abs(got - want).max() / scale
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_the_comparison_can_fail(model):
    """Negative control: a fused layer that drops its pre-norm is caught by the same bound."""
    want = logits(model, False, "float32", [len(PROMPT)])
    original = layers.DecoderLayer.fused

    def broken(self, h, step, rotations, positions):
        saved = self.attn_norm
        self.attn_norm = mx.ones_like(saved)
        try:
            return original(self, h, step, rotations, positions)
        finally:
            self.attn_norm = saved

    layers.DecoderLayer.fused = broken
    try:
        got = logits(model, True, "float32", [len(PROMPT)])
    finally:
        layers.DecoderLayer.fused = original
    assert np.abs(got - want).max() > 50 * BOUND["float32"] * np.abs(want).max(), np.abs(got - want).max()


def test_a_norm_replaced_after_a_fused_forward_takes_effect(model):
    """A norm replaced after the fused ops' arguments were gathered (as an attribute, or through
    ``Module.update``) reaches the next fused forward as it reaches the unfused one."""
    logits(model, True, "float32", [len(PROMPT)])  # gathered
    layer, other = model.layers[0], model.layers[1]
    saved, saved_other = layer.attn_norm, other.mlp_norm
    try:
        layer.attn_norm = saved * 3.0
        other.update({"mlp_norm": saved_other * 0.25})
        want = logits(model, False, "float32", [len(PROMPT)])
        got = logits(model, True, "float32", [len(PROMPT)])
    finally:
        layer.attn_norm, other.mlp_norm = saved, saved_other
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= BOUND["float32"] * scale, np.abs(got - want).max() / scale
    # control: the replaced norms change the logits (the comparison is not of two unchanged forwards)
    before = logits(model, False, "float32", [len(PROMPT)])
    assert np.abs(before - want).max() > 50 * BOUND["float32"] * scale


def test_chunked_prefill_and_decode_match_one_piece(model):
    one = logits(model, True, "float16", [len(PROMPT)])
    chunked = logits(model, True, "float16", [7, 1, 12])
    scale = np.abs(one).max()
    # the prompt's last logits and the decode steps (the chunked run has two more rows in front)
    assert np.abs(chunked[2:] - one).max() <= BOUND["float16"] * scale


def long_prompt_logits(model, fused: bool, row_limit: float, monkeypatch) -> np.ndarray:
    """A 150-token prompt in one forward, with the kernels' row limit set to ``row_limit``: its logits."""
    import engine_service.model.projections as projections

    for module in (layers, projections):
        monkeypatch.setattr(module, "kernel_max_rows", lambda: row_limit)
    monkeypatch.setattr(layers, "FUSED_OPS", fused)
    ex = ModuleExecutor.create(model, max_sessions=1, max_session_tokens=160, keep_logits=True)
    prompt = tuple((PROMPT * 8)[:150])
    out = ex.execute([ExecInput(ex.open_session(), 0, tokens=prompt)])[0]
    return np.array(out.logits)


def test_long_blocks_through_the_panel_gemm_equal_unfused(model, monkeypatch):
    """Above the row limit (AVX2's 64) the fused ops run the panel GEMM; they match the unfused ops,
    and (control) their bits differ from the dot-product kernels', so the panel flag reached them."""
    want = long_prompt_logits(model, False, 64, monkeypatch)
    got = long_prompt_logits(model, True, 64, monkeypatch)
    scale = np.abs(want).max()
    bound = 10 * BOUND["float32"]  # measured <= 8e-5: float32 rounding over 150 positions of random layers
    assert np.abs(got - want).max() <= bound * scale, np.abs(got - want).max() / scale
    tiles = long_prompt_logits(model, True, float("inf"), monkeypatch)
    assert np.abs(got - tiles).max() <= bound * scale
    assert not np.array_equal(got, tiles), "the fused ops did not take the panel GEMM"
