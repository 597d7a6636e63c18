"""fast_math against numpy float64."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.model import fast_math


def test_exp_relative_error():
    x = np.concatenate([np.linspace(-87, 87, 200_001), [0.0, -1e-8, 1e-8, 0.5, -0.5]]).astype(np.float32)
    got = np.asarray(fast_math.exp(mx.array(x)), dtype=np.float64)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 1e-6
    # saturates instead of overflowing, and tiny values go to ~0
    big = np.asarray(fast_math.exp(mx.array([200.0, -200.0, -np.inf])))
    assert np.isfinite(big).all() and big[1] < 1e-37 and big[2] < 1e-37


def test_silu_mul():
    g = np.random.default_rng(0).normal(0, 8, (64, 96)).astype(np.float32)
    u = np.random.default_rng(1).normal(0, 1, (64, 96)).astype(np.float32)
    got = np.asarray(fast_math.silu_mul(mx.array(g), mx.array(u)))
    g64 = g.astype(np.float64)
    assert np.allclose(got, g64 / (1 + np.exp(-g64)) * u, rtol=1e-5, atol=1e-6)


def naive(q, k, v, scale, mask):
    hq, n, d = q.shape
    rep = hq // k.shape[0]
    out = np.zeros((hq, n, d))
    for h in range(hq):
        s = q[h] @ k[h // rep].T * scale
        s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[h] = (p / p.sum(-1, keepdims=True)) @ v[h // rep]
    return out


@pytest.mark.parametrize("block", [128, 5])  # 5: several query blocks, the last one partial
@pytest.mark.parametrize("kind", ["causal", "bool", "none"])
def test_attention_matches_naive(kind, block, monkeypatch):
    monkeypatch.setattr(fast_math, "QUERY_BLOCK", block)
    rng = np.random.default_rng(2)
    n, s, d = 12, 20, 16
    q, k, v = (rng.normal(0, 1, shape).astype(np.float32) for shape in ((4, n, d), (2, s, d), (2, s, d)))
    causal = np.arange(s)[None, :] <= np.arange(s - n, s)[:, None]
    window = causal & (np.arange(s)[None, :] > np.arange(s - n, s)[:, None] - 5)
    mask = {"causal": causal, "bool": window, "none": np.ones((n, s), bool)}[kind]
    arg = {"causal": "causal", "bool": mx.array(window), "none": None}[kind]
    got = np.asarray(fast_math.attention(mx.array(q), mx.array(k), mx.array(v), 0.3, arg))
    assert np.allclose(got, naive(q, k, v, 0.3, mask), atol=1e-5)
    if kind == "bool":  # negative control: the window matters for this input
        assert not np.allclose(got, naive(q, k, v, 0.3, causal), atol=1e-3)


def test_masked_scores_get_exactly_zero_weight():
    s = mx.array([[0.0, -mx.inf, 1.0, -mx.inf]])
    p = np.asarray(fast_math.softmax(s))
    assert p[0, 1] == 0.0 and p[0, 3] == 0.0 and abs(p.sum() - 1) < 1e-6
