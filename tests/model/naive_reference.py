"""The tiny model's forward pass written again in plain numpy (float64), one sequence, no cache."""

from __future__ import annotations

import numpy as np

from engine_service.model.config import ModelConfig


def rope(x: np.ndarray, positions: np.ndarray, theta: float, traditional: bool) -> np.ndarray:
    """x: [T, heads, D]. traditional pairs (2i, 2i+1); otherwise (i, i + D/2)."""
    d = x.shape[-1]
    freqs = theta ** (-np.arange(0, d // 2) * 2.0 / d)
    ang = positions[:, None, None] * freqs[None, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    if traditional:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def forward(config: ModelConfig, tensors: dict, tokens: list[int]) -> np.ndarray:
    """Logits [T, vocab] for one sequence starting at position 0."""
    t = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}
    n, hq, hkv, d = len(tokens), config.num_heads, config.num_kv_heads, config.head_dim
    pos = np.arange(n, dtype=np.float64)
    h = t["embed"][tokens]
    for i, spec in enumerate(config.layers):
        p = f"layers.{i}."
        x = rms(h, t[p + "attn_norm"], config.rms_norm_eps)
        q = rope((x @ t[p + "q"].T).reshape(n, hq, d), pos, config.rope_theta, config.rope_traditional)
        k = rope((x @ t[p + "k"].T).reshape(n, hkv, d), pos, config.rope_theta, config.rope_traditional)
        v = (x @ t[p + "v"].T).reshape(n, hkv, d)
        att = np.zeros((n, hq, d))
        for head in range(hq):
            kvh = head // (hq // hkv)
            for qi in range(n):
                lo = 0 if not spec.sliding else max(0, qi - spec.window + 1)
                scores = k[lo : qi + 1, kvh] @ q[qi, head] / np.sqrt(d)
                w = np.exp(scores - scores.max())
                att[qi, head] = (w / w.sum()) @ v[lo : qi + 1, kvh]
        h = h + att.reshape(n, hq * d) @ t[p + "o"].T
        x = rms(h, t[p + "mlp_norm"], config.rms_norm_eps)
        g, u = x @ t[p + "gate"].T, x @ t[p + "up"].T
        h = h + (g / (1 + np.exp(-g)) * u) @ t[p + "down"].T
    h = rms(h, t["norm"], config.rms_norm_eps)
    head = t["lm_head"] if "lm_head" in t else t["embed"]
    return h @ head.T
