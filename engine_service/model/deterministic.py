"""Deterministic mode: every row's result independent of the batch it is computed in (block kernels for
every linear, ``causal_attention`` by absolute position); needs the compiled kernels and block weights
(:func:`problem`). Spec: docs/MODELS.md (Deterministic mode)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine_service.api.errors import FailedPrecondition
from engine_service.cache.batch_control import KVView
from engine_service.model.cpu_kernels import BUILD_HINT, kernel_status, kernels
from engine_service.model.formats.block_quant import BLOCK_FORMATS, is_block_dtype

# key positions per online-softmax chunk (chunk boundaries at multiples of this, absolute)
KEY_CHUNK = 64


def problem(weights_dtype: str) -> str | None:
    """Why deterministic mode cannot run with ``weights_dtype`` here, or None when it can."""
    ext = kernels()
    if ext is None:
        return f"deterministic mode needs the compiled kernels: {kernel_status().reason}"
    if not hasattr(ext, "causal_attention"):
        return f"deterministic mode needs forkline_kernels with causal_attention (an older build is installed); {BUILD_HINT}"
    if mx.default_device() != mx.cpu:
        return "deterministic mode runs on the CPU only (the compiled kernels have no GPU version)"
    if not is_block_dtype(weights_dtype):
        return (
            f"deterministic mode needs block-quantized weights ({' or '.join(BLOCK_FORMATS)}), got "
            f"{weights_dtype!r}: float matmuls go through BLAS, whose results depend on the row count"
        )
    return None


def require(weights_dtype: str) -> None:
    """Raise FailedPrecondition when :func:`problem` finds one."""
    why = problem(weights_dtype)
    if why is not None:
        raise FailedPrecondition(why)


def enable(model: Any) -> None:
    """Switch a Transformer (or a LoadedModel's) to deterministic mode; FailedPrecondition if it cannot."""
    model = getattr(model, "model", model)
    if not hasattr(model, "set_deterministic"):
        raise FailedPrecondition(f"{type(model).__name__} has no deterministic mode")
    model.set_deterministic(True)


def attend(
    q: mx.array, views: Sequence[KVView], positions: mx.array, window: int | None, scale: float
) -> mx.array:
    """q [T, q_heads, D] (RoPE applied), positions int32 [T], window (None: full) -> [T, q_heads * D],
    every view one row group of one kernel call."""
    ext = kernels()
    t = q.shape[0]
    ordered = views if len(views) == 1 else sorted(views, key=lambda v: v.rows.start)
    keys, values, key_pos, groups = [], [], [], []
    covered = 0
    for view in ordered:
        parts = view.parts if view.parts is not None else (view,)
        for p in parts:
            if p.positions is None:
                raise FailedPrecondition("deterministic mode needs a cache whose views carry key positions")
            keys.append(p.keys)
            values.append(p.values)
            key_pos.append(p.positions)
        start, stop, stride = view.rows.indices(t)
        if start != covered or stride != 1 or stop <= start:
            raise ValueError(f"KV views must cover the {t} packed rows once, in order")
        covered = stop
        groups.append((start, stop, len(parts)))
    if covered != t:
        raise ValueError(f"KV views cover {covered} of {t} packed rows")
    o = ext.causal_attention(
        q,
        positions,
        keys,
        values,
        key_pos,
        scale=scale,
        window=window or 0,
        chunk=KEY_CHUNK,
        groups=groups if len(groups) > 1 else [],
    )
    return o.reshape(t, -1)
