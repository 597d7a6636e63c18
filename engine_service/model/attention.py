"""Attention of packed query rows over the cache's views, on MLX ops (the path where the compiled
kernel cannot run), and the test whether it can."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx

import engine_service.model.fast_math as fast_math
from engine_service.cache.batch_control import KVView
from engine_service.model.cpu_kernels import kernels

# query rows per view below which MLX's fused attention is used (see fast_math for why not above)
_FUSED_SDPA_MAX_ROWS = 8


def kernel_attention_usable(views: list[KVView]) -> bool:
    """Whether ``forkline_kernels.causal_attention`` can run these views here: the kernels load (with
    the attention op), the stream is the CPU's, and every view or part says its keys' positions."""
    ext = kernels()
    if ext is None or not hasattr(ext, "causal_attention") or mx.default_device() != mx.cpu:
        return False
    return all(
        all(p.positions is not None for p in (view.parts if view.parts is not None else (view,)))
        for view in views
    )


def attend(q: mx.array, views: list[KVView], t: int, scale: float, layer: int) -> mx.array:
    """q: [T, q_heads, 1, D]; each view's rows attend its keys/values [kv_heads, S, D] (any float dtype:
    computed in float32). -> [T, q_heads * D]. The MLX path, where the compiled kernel cannot run."""
    views = [_float32_view(v) for v in views]
    ordered = sorted(views, key=lambda view: view.rows.start)
    outs = []
    covered = 0
    for view in ordered:
        start, stop, stride = view.rows.indices(t)
        if start != covered or stride != 1 or stop <= start:
            raise ValueError(f"layer {layer}: KV views must cover the {t} packed rows once, in order")
        covered = stop
        n = stop - start
        if view.parts is not None:  # several pool slices: one softmax across them, no gather
            qv = q[start:stop, :, 0, :].transpose(1, 0, 2)  # [q_heads, n, D]
            parts = [(p.keys, p.values, p.mask) for p in view.parts]
            o = fast_math.attention_parts(qv, parts, scale)
            outs.append(o.transpose(1, 0, 2).reshape(n, -1))
            continue
        if n == 1:  # a decode row is already [1, q_heads, 1, D], sdpa's [B, H, L, D]: no transposes
            o = mx.fast.scaled_dot_product_attention(
                q[start:stop], view.keys[None], view.values[None], scale=scale, mask=view.mask
            )
            outs.append(o.reshape(1, -1))
            continue
        qv = q[start:stop, :, 0, :].transpose(1, 0, 2)  # [q_heads, n, D]
        if n < _FUSED_SDPA_MAX_ROWS:  # a few rows: one fused op; few exponentials to compute
            o = mx.fast.scaled_dot_product_attention(
                qv[None], view.keys[None], view.values[None], scale=scale, mask=view.mask
            )[0]
        else:  # prefill: BLAS matmuls + the fast softmax (MLX's CPU exp dominates otherwise)
            o = fast_math.attention(qv, view.keys, view.values, scale, view.mask)
        outs.append(o.transpose(1, 0, 2).reshape(n, -1))
    if covered != t:
        raise ValueError(f"layer {layer}: KV views cover {covered} of {t} packed rows")
    return outs[0] if len(outs) == 1 else mx.concatenate(outs)


def _float32_view(view: KVView) -> KVView:
    """A view whose keys/values are float32 (a half-precision cache on the MLX path: one upcast)."""

    def up(x: mx.array | None) -> mx.array | None:
        return x if x is None or x.dtype == mx.float32 else x.astype(mx.float32)

    if view.parts is not None:
        if all(p.keys.dtype == mx.float32 for p in view.parts):
            return view
        return replace(
            view, parts=tuple(replace(p, keys=up(p.keys), values=up(p.values)) for p in view.parts)
        )
    if view.keys.dtype == mx.float32:
        return view
    return replace(view, keys=up(view.keys), values=up(view.values))
