"""Elementwise math that MLX's CPU backend runs slowly (a scalar ``exp`` per element), rewritten from
fast primitives: ``exp`` as range reduction + a polynomial fused by ``mx.compile`` (~6x, relative error
< 1e-6), and the softmax, gating and prefill attention built on it."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from engine_service.model.formats.weights import gpu_available

log = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634
# ln 2 split so that n * _LN2_HI is exact in float32 for |n| <= 127 (Cody-Waite range reduction)
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
# Taylor coefficients of e**r to degree 7; with |r| <= ln(2)/2 the truncation error is ~5e-9.
_COEFFS = tuple(1.0 / math.factorial(k) for k in range(8))
# 1.5 * 2**23: (v + _ROUND) - _ROUND is v rounded to the nearest integer in float32 arithmetic, |v| < 2**22
_ROUND = 12582912.0


def _exp(x: mx.array) -> mx.array:
    """e**x for float32 x as 2**n * e**r; saturates at 2**126, exactly 0 below ~e**-87.7 (masked scores)."""
    # where() instead of clip() and the add-and-subtract rounding instead of round(): MLX's clip checks
    # for NaN per element and its round is a libm call, both of which keep the JIT-compiled loop from
    # vectorising (measured ~1.4x slower). NaN still propagates: it fails every comparison below.
    v = x * _LOG2E
    v = mx.where(v < -127.0, -127.0, mx.where(v > 126.0, 126.0, v))
    n = (v + _ROUND) - _ROUND
    x = mx.where(x < -88.5, -88.5, mx.where(x > 88.0, 88.0, x))
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _COEFFS[7]
    for c in reversed(_COEFFS[:7]):
        p = p * r + c
    scale = ((n.astype(mx.int32) + 127) << 23).view(mx.float32)  # 2**n built from the exponent bits
    return p * scale


def _silu_mul(g: mx.array, u: mx.array) -> mx.array:
    """silu(g) * u = g * u / (1 + e**-g)."""
    return g * u / (1.0 + _exp(-g))


# 2 * sqrt(2 / pi): 0.5 * (1 + tanh(y)) = sigmoid(2 y)
_GELU_2C = 1.5957691216057308


def _gelu_tanh_mul(g: mx.array, u: mx.array) -> mx.array:
    """gelu_tanh(g) * u = g * u / (1 + e**(-2 c (g + 0.044715 g**3))) (Gemma's ``gelu_pytorch_tanh``)."""
    return g * u / (1.0 + _exp(-_GELU_2C * (g + 0.044715 * g * g * g)))


class _Fused:
    """``mx.compile(fn)``, falling back to ``fn`` for good if compilation fails (no C++ compiler)."""

    def __init__(self, fn: Callable[..., mx.array]) -> None:
        self._fn = fn
        self._compiled: Callable[..., mx.array] | None = mx.compile(fn)

    def __call__(self, *args: mx.array) -> mx.array:
        if self._compiled is not None:
            try:
                return self._compiled(*args)
            except (RuntimeError, ValueError) as exc:  # the CPU JIT needs a working compiler
                log.warning("mx.compile unavailable (%s); using uncompiled %s", exc, self._fn.__name__)
                self._compiled = None
        return self._fn(*args)


def _exp_sub(x: mx.array, m: mx.array) -> mx.array:
    """e**(x - m), the subtraction fused into the exp kernel (one pass fewer over the scores)."""
    return _exp(x - m)


def _rotate(x: mx.array, swapped: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    return x * cos + swapped * sin


exp = _Fused(_exp)
exp_sub = _Fused(_exp_sub)
silu_mul = _Fused(_silu_mul)
gelu_tanh_mul = _Fused(_gelu_tanh_mul)
_rotate_fused = _Fused(_rotate)


class RmsNorm:
    """``mx.fast.rms_norm`` for x [T, hidden]; for a few rows (decode) a compiled elementwise version, which
    is faster there on MLX's CPU backend."""

    MAX_COMPILED_ROWS = 8

    def __init__(self, eps: float) -> None:
        self.eps = eps

        def norm(x: mx.array, weight: mx.array) -> mx.array:
            return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * weight

        norm.__name__ = "rms_norm"
        self._compiled = _Fused(norm) if _ON_CPU else None

    def __call__(self, x: mx.array, weight: mx.array) -> mx.array:
        if self._compiled is not None and x.shape[0] <= self.MAX_COMPILED_ROWS:
            return self._compiled(x, weight)
        return mx.fast.rms_norm(x, weight, self.eps)


@functools.lru_cache(maxsize=16)
def rms_norm(eps: float) -> RmsNorm:
    """The shared :class:`RmsNorm` for ``eps`` (one compiled function per model family, not per layer)."""
    return RmsNorm(eps)


def rope_tables(positions: mx.array, dims: int, base: float, traditional: bool) -> tuple[mx.array, mx.array]:
    """cos, sin float32 [T, 1, dims] for :func:`rope` at positions [T], once per forward for every layer
    (angles in float64 on the host). ``sin`` carries each output's sign: out = x * cos + swap(x) * sin."""
    freqs = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)  # [dims / 2]
    ang = np.asarray(positions, dtype=np.float64)[:, None] * freqs[None, :]  # [T, dims / 2]
    c, s = np.cos(ang), np.sin(ang)
    if traditional:
        cos = np.repeat(c, 2, axis=-1)
        sin = np.stack([-s, s], axis=-1).reshape(c.shape[0], dims)
    else:
        cos = np.concatenate([c, c], axis=-1)
        sin = np.concatenate([-s, s], axis=-1)
    return mx.array(cos[:, None, :].astype(np.float32)), mx.array(sin[:, None, :].astype(np.float32))


def rope(x: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> mx.array:
    """x: [T, heads, dims] rotated by the tables of :func:`rope_tables` ([T, 1, dims])."""
    t, heads, dims = x.shape
    if traditional:  # swap each adjacent pair (2i, 2i + 1)
        swapped = x.reshape(t, heads, dims // 2, 2)[..., ::-1].reshape(t, heads, dims)
    else:  # swap the two halves
        half = dims // 2
        swapped = mx.concatenate([x[..., half:], x[..., :half]], axis=-1)
    return _rotate_fused(x, swapped, cos, sin)


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis; masked (-inf) entries get exactly zero weight."""
    e = exp_sub(scores, mx.max(scores, axis=-1, keepdims=True))
    return e * (1.0 / mx.sum(e, axis=-1, keepdims=True))


# On the CPU the attention temporaries are [kv_heads, group * QUERY_BLOCK, KEY_BLOCK] (1.2 MB for
# SmolLM2) whatever the history length. Why it matters: MLX's CPU allocator is plain malloc, which hands
# big freed buffers back to the OS, so a pass over a fresh multi-MB temporary page-faults on every page
# (measured: more system time than compute at 2k keys with [heads, 128, S] blocks, and 1.7x slower
# prefill at 2k history than these chunks). Fixed, small temporaries are recycled without faults.
QUERY_BLOCK = 64
KEY_BLOCK = 512
# on an accelerator the allocator problem does not exist and every extra op is a kernel launch: 128-row
# blocks over all their keys at once (the blocking this module had before the key chunks)
GPU_QUERY_BLOCK = 128
_ON_CPU = not gpu_available()
# running max before any key is seen: finite, so a chunk whose keys are all masked for a row gives
# exp(-inf - _NO_MAX) = 0 and rescales by exp(0) = 1 instead of producing NaN from (-inf) - (-inf)
_NO_MAX = -1e30


def attention(
    q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """Grouped-query attention for a block of query rows: q [q_heads, n, D]; keys, values [kv_heads, S, D];
    mask bool [n, S], "causal" or None -> [q_heads, n, D] (NaN for a row that sees no key). Heads sharing
    a kv head are stacked as rows; an online softmax over KEY_BLOCK chunks, causal blocks read only their
    history and diagonal square."""
    hq, n, d = q.shape
    hkv, s, _ = keys.shape
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"unknown mask {mask!r}")
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    rep = hq // hkv
    block, chunk = (QUERY_BLOCK, KEY_BLOCK) if _ON_CPU else (GPU_QUERY_BLOCK, max(s, 1))
    qs = q * scale
    outs = []
    for a in range(0, n, block):
        b = min(n, a + block)
        qg = qs[:, a:b].reshape(hkv, rep * (b - a), d)
        if isinstance(mask, str):
            o = _causal_block(qg, keys, values, s - n + a, b - a, chunk)
        else:
            o = _masked_block(qg, keys, values, None if mask is None else mask[a:b], chunk)
        outs.append(o.reshape(hq, b - a, d))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)


class _Online:
    """Online-softmax state for rows [kv_heads, R]: running max, sum [.., R, 1], output [.., R, D]."""

    def __init__(self, qg: mx.array) -> None:
        self.qg = qg
        self.m: mx.array | None = None
        self.total: mx.array | None = None
        self.out: mx.array | None = None

    def add(self, keys: mx.array, values: mx.array, mask: mx.array | None) -> None:
        """keys, values: [kv_heads, K, D]; mask: bool broadcastable to [kv_heads, group, rows, K] or None."""
        hkv, r, _ = self.qg.shape
        scores = self.qg @ keys.transpose(0, 2, 1)  # [kv_heads, R, K]
        if mask is not None:
            k = keys.shape[1]
            rows = mask.shape[-2]
            scores = mx.where(mask, scores.reshape(hkv, r // rows, rows, k), -mx.inf).reshape(hkv, r, k)
        chunk_max = mx.max(scores, axis=-1, keepdims=True)
        if self.m is None:
            m = mx.maximum(chunk_max, _NO_MAX) if mask is not None else chunk_max
            e = exp_sub(scores, m)
            self.total = mx.sum(e, axis=-1, keepdims=True)
            self.out = e @ values
        else:
            m = mx.maximum(self.m, chunk_max)
            alpha = exp_sub(self.m, m)  # rescales what was summed under the old max
            e = exp_sub(scores, m)
            self.total = self.total * alpha + mx.sum(e, axis=-1, keepdims=True)
            self.out = self.out * alpha + e @ values
        self.m = m

    def result(self) -> mx.array:
        return self.out * (1.0 / self.total)


def _causal_block(
    qg: mx.array, keys: mx.array, values: mx.array, first: int, rows: int, chunk: int
) -> mx.array:
    """qg [kv_heads, group * rows, D], row j at key ``first + j`` -> [kv_heads, group * rows, D]."""
    end = first + rows
    acc = _Online(qg)
    # the diagonal square first: every row sees its own key, so the running max starts finite
    tri = mx.arange(rows)[None, :] <= mx.arange(rows)[:, None]  # [rows, rows]: key j <= row i
    acc.add(keys[:, first:end], values[:, first:end], tri)
    for c0 in range(0, first, chunk):  # the history before the block: visible to every row
        c1 = min(first, c0 + chunk)
        acc.add(keys[:, c0:c1], values[:, c0:c1], None)
    return acc.result()


def _masked_block(
    qg: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None, chunk: int
) -> mx.array:
    """qg [kv_heads, group * rows, D]; mask bool [rows, S] or None -> [kv_heads, group * rows, D]."""
    acc = _Online(qg)
    for c0 in range(0, keys.shape[1], chunk):
        c1 = min(keys.shape[1], c0 + chunk)
        acc.add(keys[:, c0:c1], values[:, c0:c1], None if mask is None else mask[:, c0:c1])
    return acc.result()


# below this many query rows a multi-part view concatenates the parts' small score tensors and takes one
# softmax (fewest ops for decode); larger blocks go through the online softmax, part by part
PARTS_CONCAT_MAX_ROWS = 8


def attention_parts(
    q: mx.array, parts: Sequence[tuple[mx.array, mx.array, mx.array | None]], scale: float
) -> mx.array:
    """:func:`attention` over several key/value pieces as if concatenated (one softmax, no copy): parts
    ``(keys, values [kv_heads, S_i, D], mask bool [n, S_i] or None)``."""
    hq, n, d = q.shape
    hkv = parts[0][0].shape[0]
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    rep = hq // hkv
    qs = q * scale
    if n < PARTS_CONCAT_MAX_ROWS:
        qg = qs.reshape(hkv, rep * n, d)
        scores = []
        for keys, _, mask in parts:
            s = qg @ keys.transpose(0, 2, 1)  # [kv_heads, rep * n, S_i]
            if mask is not None:
                k = keys.shape[1]
                s = mx.where(mask, s.reshape(hkv, rep, n, k), -mx.inf).reshape(hkv, rep * n, k)
            scores.append(s)
        # MLX's own softmax, not the compiled one above: the key count changes every decode step and a
        # compiled function is retraced for every new shape (measured slower than the scalar exps here)
        w = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1)  # [kv_heads, rep * n, sum S_i]
        out = None
        at = 0
        for keys, values, _ in parts:
            k = keys.shape[1]
            term = w[..., at : at + k] @ values
            out = term if out is None else out + term
            at += k
        return out.reshape(hq, n, d)
    block = QUERY_BLOCK if _ON_CPU else GPU_QUERY_BLOCK
    outs = []
    for a in range(0, n, block):
        b = min(n, a + block)
        acc = _Online(qs[:, a:b].reshape(hkv, rep * (b - a), d))
        for keys, values, mask in parts:
            s = keys.shape[1]
            chunk = KEY_BLOCK if _ON_CPU else max(s, 1)
            for c0 in range(0, s, chunk):
                c1 = min(s, c0 + chunk)
                acc.add(keys[:, c0:c1], values[:, c0:c1], None if mask is None else mask[a:b, c0:c1])
        outs.append(acc.result().reshape(hq, b - a, d))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
