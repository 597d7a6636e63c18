"""The attention op under test (kernels/src/attention.cpp), its float64 reference and the shared cases."""

from __future__ import annotations

import numpy as np
import pytest

import engine_service  # noqa: F401  (OpenBLAS before mlx)

mx = pytest.importorskip("mlx.core")
fk = pytest.importorskip("forkline_kernels", reason="compiled kernels not built (scripts/setup.sh)")
if not hasattr(fk, "causal_attention"):
    pytest.skip(
        "forkline_kernels predates causal_attention: rebuild (scripts/setup.sh)", allow_module_level=True
    )


def reference(q, q_pos, keys, values, key_pos, scale, window):
    """float64: q [n, Hq, D]; keys/values [Hkv, S, D]; key_pos [S] -> [n, Hq, D]."""
    n, hq, d = q.shape
    rep = hq // keys.shape[0]
    out = np.full((n, hq, d), np.nan)
    for i, p in enumerate(q_pos):
        lo = max(0, p - window + 1) if window else 0
        vis = (key_pos >= lo) & (key_pos <= p) & (key_pos >= 0)
        if not vis.any():
            continue
        for h in range(hq):
            k = keys[h // rep][vis].astype(np.float64)
            v = values[h // rep][vis].astype(np.float64)
            s = scale * (k @ q[i, h].astype(np.float64))
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v
    return out


def run(q, q_pos, parts, scale, window=0, chunk=64):
    """parts: [(keys, values, key_pos)] as numpy."""
    o = fk.causal_attention(
        mx.array(q),
        mx.array(np.asarray(q_pos, dtype=np.int32)),
        [mx.array(k) for k, _, _ in parts],
        [mx.array(v) for _, v, _ in parts],
        [mx.array(np.asarray(p, dtype=np.int32)) for _, _, p in parts],
        scale=scale,
        window=window,
        chunk=chunk,
    )
    return np.array(o)


def make(rng, s, hq, hkv, d, spread=3.0):
    """q [s, Hq, D] and keys/values [Hkv, s, D] for positions 0..s-1 (spread: score magnitude)."""
    q = (rng.standard_normal((s, hq, d)) * spread / np.sqrt(d) ** 0.5).astype(np.float32)
    k = (rng.standard_normal((hkv, s, d)) * np.sqrt(d) ** 0.5).astype(np.float32)
    v = rng.standard_normal((hkv, s, d)).astype(np.float32)
    return q, k, v


CASES = [  # (rows, keys, Hq, Hkv, D, window, chunk)
    (1, 1, 1, 1, 8, 0, 64),
    (7, 40, 6, 2, 64, 0, 64),
    (33, 300, 9, 3, 64, 0, 64),
    (16, 100, 4, 4, 20, 0, 7),
    (20, 130, 18, 2, 32, 0, 16),  # 9 q heads per kv head: more than one group of 8
    (40, 200, 6, 3, 64, 17, 8),
    (5, 90, 2, 1, 12, 1, 64),
    (3, 150, 8, 2, 256, 0, 64),  # Gemma 3's head_dim, 4 q heads per kv head
    (2, 70, 5, 1, 40, 0, 64),  # 5 per kv head; head_dim 40 (a 16-float tail of 8)
]

LEVELS = ["scalar", "avx2", "avx512"]

ISAS = LEVELS[: LEVELS.index(fk.best_isa()) + 1]  # the ones this CPU runs
