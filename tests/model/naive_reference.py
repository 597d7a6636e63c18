"""The forward pass written again in plain numpy (float64), one sequence, no cache, from each
architecture's published definition (not from the engine's code):

- llama / mistral: pre-norm, RoPE, SwiGLU; qwen2 adds a bias to q/k/v; qwen3 RMS-norms each q/k head
  before RoPE; phi3 stores q/k/v and gate/up fused (gate rows first).
- gemma3: embeddings times sqrt(hidden); QK-norm; a norm after attention and after the MLP as well as
  before each; GELU (tanh approximation) gating; RoPE base ``rope_local_theta`` on sliding layers;
  scores scaled by ``attn_scale``; the head tied to the unscaled embedding.

A sliding layer lets query ``i`` see keys ``j`` with ``i - window < j <= i``.
"""

from __future__ import annotations

import math

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


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _attention(q, k, v, spec, scale) -> np.ndarray:
    """q: [n, hq, d], k/v: [n, hkv, d] -> [n, hq * d]."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    att = np.zeros((n, hq, d))
    for head in range(hq):
        kvh = head // (hq // hkv)
        for qi in range(n):
            lo = 0 if not spec.sliding else max(0, qi - spec.window + 1)
            scores = k[lo : qi + 1, kvh] @ q[qi, head] * scale
            w = np.exp(scores - scores.max())
            att[qi, head] = (w / w.sum()) @ v[lo : qi + 1, kvh]
    return att.reshape(n, hq * d)


def forward(config: ModelConfig, tensors: dict, tokens: list[int]) -> np.ndarray:
    """Logits [T, vocab] for one sequence starting at position 0 (any architecture above)."""
    t = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}
    arch = config.architecture
    gemma = arch == "gemma3"
    n, hq, hkv, d = len(tokens), config.num_heads, config.num_kv_heads, config.head_dim
    eps = config.rms_norm_eps
    scale = config.attn_scale if config.attn_scale is not None else 1 / np.sqrt(d)
    pos = np.arange(n, dtype=np.float64)
    h = t["embed"][tokens] * (np.sqrt(config.hidden_size) if gemma else 1.0)
    for i, spec in enumerate(config.layers):
        p = f"layers.{i}."
        theta = config.rope_local_theta if spec.sliding and config.rope_local_theta else config.rope_theta
        x = rms(h, t[p + "attn_norm"], eps)
        if p + "qkv" in t:
            q, k, v = np.split(x @ t[p + "qkv"].T, [hq * d, hq * d + hkv * d], axis=-1)
        else:
            q, k, v = x @ t[p + "q"].T, x @ t[p + "k"].T, x @ t[p + "v"].T
        if p + "q_bias" in t:
            q, k, v = q + t[p + "q_bias"], k + t[p + "k_bias"], v + t[p + "v_bias"]
        q, k, v = q.reshape(n, hq, d), k.reshape(n, hkv, d), v.reshape(n, hkv, d)
        if p + "q_norm" in t:
            q, k = rms(q, t[p + "q_norm"], eps), rms(k, t[p + "k_norm"], eps)
        q = rope(q, pos, theta, config.rope_traditional)
        k = rope(k, pos, theta, config.rope_traditional)
        a = _attention(q, k, v, spec, scale) @ t[p + "o"].T
        h = h + (rms(a, t[p + "post_attn_norm"], eps) if gemma else a)
        x = rms(h, t[p + "mlp_norm"], eps)
        if p + "gate_up" in t:
            g, u = np.split(x @ t[p + "gate_up"].T, 2, axis=-1)
        else:
            g, u = x @ t[p + "gate"].T, x @ t[p + "up"].T
        m = ((gelu_tanh(g) if gemma else silu(g)) * u) @ t[p + "down"].T
        h = h + (rms(m, t[p + "post_mlp_norm"], eps) if gemma else m)
    h = rms(h, t["norm"], eps)
    head = t["lm_head"] if "lm_head" in t else t["embed"]
    return h @ head.T
