"""Chunked prefill over a long history: fast_math's row blocks x key chunks (online softmax) against
float64 references, for both mask kinds ("causal" and bool) and through the real caches.

QUERY_BLOCK / KEY_BLOCK are shrunk so that small inputs cross many row blocks and key chunks, with
partial last chunks, key chunks that are fully masked for some rows, and a history longer than a chunk.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.cache.batch_control import Segment
from engine_service.cache.config import CacheConfig
from engine_service.cache.registry import build_cache
from engine_service.model import fast_math
from engine_service.model.random_init import random_tensors, tiny_config
from engine_service.model.transformer import Transformer
from tests.model import naive_reference


def naive(q, k, v, scale, mask):
    """float64 attention, one q head at a time against its kv head (no grouping tricks)."""
    hq, n, d = q.shape
    rep = hq // k.shape[0]
    out = np.zeros((hq, n, d))
    for h in range(hq):
        s = q[h].astype(np.float64) @ k[h // rep].T.astype(np.float64) * scale
        s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[h] = (p / p.sum(-1, keepdims=True)) @ v[h // rep]
    return out


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(fast_math, "QUERY_BLOCK", 4)
    monkeypatch.setattr(fast_math, "KEY_BLOCK", 5)


@pytest.mark.parametrize("kind", ["causal", "window", "none"])
@pytest.mark.parametrize("n,history", [(10, 23), (3, 0), (9, 5)])
def test_blocked_attention_matches_naive(small_blocks, kind, n, history):
    rng = np.random.default_rng(7)
    s, d = history + n, 8
    q = rng.normal(0, 2, (6, n, d)).astype(np.float32)  # 6 q heads over 2 kv heads
    k, v = (rng.normal(0, 2, (2, s, d)).astype(np.float32) for _ in range(2))
    qpos = np.arange(history, s)[:, None]
    causal = np.arange(s)[None, :] <= qpos
    # window 3: late rows see none of the first key chunks (the running max must survive all -inf chunks)
    window = causal & (np.arange(s)[None, :] > qpos - 3)
    mask = {"causal": causal, "window": window, "none": np.ones((n, s), bool)}[kind]
    arg = {"causal": "causal", "window": mx.array(window), "none": None}[kind]
    got = np.asarray(fast_math.attention(mx.array(q), mx.array(k), mx.array(v), 0.4, arg))
    want = naive(q, k, v, 0.4, mask)
    assert np.isfinite(got).all()
    assert np.allclose(got, want, atol=2e-5), np.abs(got - want).max()
    if kind != "none" and history:  # negative control: the mask matters for this input
        assert not np.allclose(got, naive(q, k, v, 0.4, np.ones((n, s), bool)), atol=1e-3)


@pytest.mark.parametrize("kind", ["causal", "window"])
def test_accelerator_blocking_matches_naive(monkeypatch, kind):
    """On a GPU the keys are not chunked (one chunk per row block): same results."""
    monkeypatch.setattr(fast_math, "_ON_CPU", False)
    monkeypatch.setattr(fast_math, "GPU_QUERY_BLOCK", 4)
    rng = np.random.default_rng(9)
    n, s, d = 10, 30, 8
    q = rng.normal(0, 2, (6, n, d)).astype(np.float32)
    k, v = (rng.normal(0, 2, (2, s, d)).astype(np.float32) for _ in range(2))
    qpos = np.arange(s - n, s)[:, None]
    causal = np.arange(s)[None, :] <= qpos
    mask = causal if kind == "causal" else causal & (np.arange(s)[None, :] > qpos - 3)
    arg = "causal" if kind == "causal" else mx.array(mask)
    got = np.asarray(fast_math.attention(mx.array(q), mx.array(k), mx.array(v), 0.4, arg))
    assert np.allclose(got, naive(q, k, v, 0.4, mask), atol=2e-5)


def test_blocked_attention_matches_unblocked(monkeypatch):
    """The chunking is invisible: tiny blocks and one block give the same result (float32 both)."""
    rng = np.random.default_rng(8)
    q = mx.array(rng.normal(0, 3, (6, 17, 8)).astype(np.float32))
    k, v = (mx.array(rng.normal(0, 3, (2, 50, 8)).astype(np.float32)) for _ in range(2))
    whole = fast_math.attention(q, k, v, 0.5, "causal")
    monkeypatch.setattr(fast_math, "QUERY_BLOCK", 3)
    monkeypatch.setattr(fast_math, "KEY_BLOCK", 7)
    blocked = fast_math.attention(q, k, v, 0.5, "causal")
    assert np.allclose(np.asarray(blocked), np.asarray(whole), atol=1e-5)


def test_row_that_sees_nothing_is_nan_not_a_guess(small_blocks):
    q = mx.ones((2, 2, 4))
    k = v = mx.ones((1, 12, 4))
    mask = np.ones((2, 12), bool)
    mask[1] = False
    got = np.asarray(fast_math.attention(q, k, v, 1.0, mx.array(mask)))
    assert np.allclose(got[:, 0], 1.0) and np.isnan(got[:, 1]).all()


TOKENS = [(7 * i + 3) % 128 for i in range(48)]
OTHER = [(11 * i + 5) % 128 for i in range(48)]


@pytest.mark.parametrize("cache_kind", ["batched-sequence", "batched-cell"])
def test_long_history_chunks_match_numpy_forward(small_blocks, cache_kind):
    """Two sequences prefilled together in 16-row chunks (cell cache: interleaved cells, so bool masks;
    sequence cache: "causal" on full layers, bool ring masks on sliding ones); every chunk's logits
    against the float64 numpy forward of the whole sequence."""
    config = tiny_config("FRFR", 4)
    tensors = random_tensors(config, seed=5)
    model = Transformer(config, tensors)
    cache = build_cache(
        cache_kind,
        CacheConfig(
            capacity=128,
            max_seqs=2,
            layers=tuple(config.layers),
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            initial_capacity=16,
            max_write=16,
        ),
    )
    seqs = {cache.seq_new(): TOKENS, cache.seq_new(): OTHER}
    want = {sid: naive_reference.forward(config, tensors, toks) for sid, toks in seqs.items()}
    for start in range(0, 48, 16):
        step = cache.begin_step([Segment(sid, start, 16) for sid in seqs])
        tokens = mx.array([t for toks in seqs.values() for t in toks[start : start + 16]], dtype=mx.int32)
        positions = mx.array([p for _ in seqs for p in range(start, start + 16)], dtype=mx.int32)
        logits = model(step, positions, tokens=tokens)
        mx.eval(logits, *step.state())
        got = np.asarray(logits, dtype=np.float64)
        for i, sid in enumerate(seqs):
            rows = got[16 * i : 16 * (i + 1)]
            ref = want[sid][start : start + 16]
            assert np.allclose(rows, ref, atol=1e-4, rtol=1e-4), (start, np.abs(rows - ref).max())
        if start:  # negative control: the other sequence's history gives different logits
            assert not np.allclose(got[:16], want[list(seqs)[1]][start : start + 16], atol=1e-2)
