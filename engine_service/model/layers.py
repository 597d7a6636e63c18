"""What every architecture builds its layers from: :class:`DecoderLayer` (an architecture's layer only
says in which order norms, attention and MLP compose) over the canonical tensors ``layers.i.*``.
Spec: docs/MODELS.md (Architectures: canonical tensor names)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

import engine_service.model.deterministic as deterministic
import engine_service.model.fast_math as fast_math
from engine_service.cache.batch_control import KVStep
from engine_service.model.attention import attend, kernel_attention_usable
from engine_service.model.config import ModelConfig
from engine_service.model.cpu_kernels import kernel_max_rows, kernels
from engine_service.model.formats.weights import gpu_available
from engine_service.model.projections import Projection, SplitProjection, Tensor, convert, fused_projection

Rotations = Mapping[float, tuple[mx.array, mx.array]]

_ON_CPU = not gpu_available()
# whether layers run their fused ops where they can (DecoderLayer.fuses); off: the unfused MLX ops,
# for comparisons (benchmarks, tests)
FUSED_OPS = True
# whether a fused layer runs as one op (forkline_kernels.DecoderLayer) where the step can describe its
# K/V for it; off: the five fused ops and the step's views (the same values; for comparisons)
LAYER_OP = True

ACTIVATIONS = {"silu": fast_math.silu_mul, "gelu_tanh": fast_math.gelu_tanh_mul}


@dataclass(frozen=True)
class _FusedCalls:
    """A layer's fixed fused-op arguments, gathered once; setting an attribute or item drops them."""

    kv_hint: list
    qkv: tuple
    qkv_kw: dict
    o: tuple
    o_kw: dict
    gate_up: tuple
    gate_up_kw: dict
    down: tuple
    down_kw: dict
    layer: object  # forkline_kernels.DecoderLayer, or None (an older build)


class DecoderLayer(nn.Module):
    """Attention + gated MLP of one layer; subclasses write ``__call__(h, step, rotations, positions)``
    from :meth:`attention`, :meth:`mlp`, :meth:`norm`. Optional tensors (bias, QK-norm, post norms) apply
    when present."""

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        tensors: Mapping[str, Tensor],
        weights_dtype: str,
        *,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        p = f"layers.{index}."
        self.index = index
        for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm"):
            if p + name in tensors:
                setattr(self, name, tensors[p + name].astype(mx.float32))
        self.qkv = _fused(tensors, p, ("q", "k", "v"), "qkv", weights_dtype)
        self.o = Projection(convert(tensors[p + "o"], weights_dtype))
        self.gate_up = _fused(tensors, p, ("gate", "up"), "gate_up", weights_dtype)
        self.down = Projection(convert(tensors[p + "down"], weights_dtype))
        self._cfg = config
        self._split = (config.q_size, config.q_size + config.kv_size)
        self._scale = config.attn_scale if config.attn_scale is not None else config.head_dim**-0.5
        self._norm = fast_math.rms_norm(config.rms_norm_eps)
        spec = config.layers[index]
        self._window = spec.window
        self.rope_theta = config.layer_rope_theta(index)
        self._act = ACTIVATIONS[activation]
        self._activation = activation
        self.deterministic = False  # batch-invariant attention (see engine_service.model.deterministic)
        self._fusion = _fusion(self)
        # the K/V dtype the cache stores (learned from the first views it returns; shared by the model's
        # layers): the fused q/k/v op writes k and v in it, so the cache needs no cast
        self.kv_hint: list[mx.Dtype] = [mx.float32]

    def fuses(self, rows: int) -> bool:
        """Whether ``rows`` packed rows run :meth:`fused`: the kernels on a CPU stream, block-quantized
        projections of one format each (any row count: above :func:`kernel_max_rows` through the panel
        GEMM unless deterministic)."""
        return FUSED_OPS and self._fusion is not None and mx.default_device() == mx.cpu

    def panel(self, rows: int) -> bool:
        """Whether a fused op over ``rows`` rows runs the panel GEMM (above :func:`kernel_max_rows`,
        never when deterministic)."""
        return not self.deterministic and rows > kernel_max_rows()

    def fused(self, h: mx.array, step: KVStep, rotations: Rotations, positions: mx.array) -> mx.array:
        """The layer as five fused kernel ops (qkv, attention, o + residual, norm + gate/up, down +
        residual), with the optional norms the layer has; row-local like the unfused ops."""
        ext, calls = self._fusion, self._calls or self._gather_calls()
        cos, sin = rotations[self.rope_theta]
        hint = calls.kv_hint
        panel = self.panel(h.shape[0])
        layer_io = getattr(step, "layer_io", None) if LAYER_OP and positions is not None else None
        io = layer_io(self.index) if layer_io is not None and calls.layer is not None else None
        if io is not None:
            h, keys, values = calls.layer(
                h, cos, sin, io.keys, io.values, io.writes, positions, io.parts, io.groups, panel
            )
            step.commit(self.index, keys, values)
            return h
        q, k, v = ext.fused_qkv(
            h, *calls.qkv, cos=cos, sin=sin, kv_dtype=hint[0], panel=panel, **calls.qkv_kw
        )
        views = step.views(self.index, k, v)
        first = views[0].parts[0] if views[0].parts is not None else views[0]
        if first.keys.dtype != hint[0]:
            hint[0] = first.keys.dtype
        if self.deterministic or (positions is not None and kernel_attention_usable(views)):
            a = deterministic.attend(q, views, positions, self._window, self._scale)
        else:
            a = attend(q[:, :, None, :], views, h.shape[0], self._scale, self.index)
        h = ext.fused_linear(a, *calls.o, residual=h, panel=panel, **calls.o_kw)
        m = ext.fused_linear(h, *calls.gate_up, panel=panel, **calls.gate_up_kw)
        return ext.fused_linear(m, *calls.down, residual=h, panel=panel, **calls.down_kw)

    def _gather_calls(self) -> _FusedCalls:
        # read through mlx.nn.Module lookups on every layer of every step, these cost about as much as
        # creating the ops (decode's graph build competes with the kernels for the cores)
        cfg, eps = self._cfg, self._norm.eps
        qkv, o, gate_up, down = self.qkv, self.o, self.gate_up, self.down
        ext_layer = getattr(self._fusion, "DecoderLayer", None)
        heads = dict(
            q_heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            eps=eps,
            q_norm=self.get("q_norm"),
            k_norm=self.get("k_norm"),
            traditional=cfg.rope_traditional,
        )
        calls = _FusedCalls(
            kv_hint=self.kv_hint,
            qkv=qkv.fused_args(),
            qkv_kw=dict(heads, norm=self.attn_norm, bias=qkv.get("bias"), qk_eps=eps),
            o=o.fused_args(),
            o_kw=dict(bias=o.get("bias"), post_norm=self.get("post_attn_norm"), post_eps=eps),
            gate_up=gate_up.fused_args(),
            gate_up_kw=dict(norm=self.mlp_norm, eps=eps, bias=gate_up.get("bias"), act=self._activation),
            down=down.fused_args(),
            down_kw=dict(bias=down.get("bias"), post_norm=self.get("post_mlp_norm"), post_eps=eps),
            layer=self._layer_call(ext_layer, heads) if ext_layer is not None else None,
        )
        self._calls = calls
        return calls

    def _layer_call(self, ext_layer, heads: dict):
        """The layer's fixed arguments held by a ``forkline_kernels.DecoderLayer`` (one op a layer)."""
        qkv, o, gate_up, down = self.qkv, self.o, self.gate_up, self.down
        return ext_layer(
            qkv.fused_args(),
            **heads,
            attn_norm=self.attn_norm,
            qkv_bias=qkv.get("bias"),
            scale=self._scale,
            window=self._window or 0,
            chunk=deterministic.KEY_CHUNK,
            o=o.fused_args(),
            o_bias=o.get("bias"),
            post_attn_norm=self.get("post_attn_norm"),
            gate_up=gate_up.fused_args(),
            mlp_norm=self.mlp_norm,
            gate_up_bias=gate_up.get("bias"),
            act=self._activation,
            down=down.fused_args(),
            down_bias=down.get("bias"),
            post_mlp_norm=self.get("post_mlp_norm"),
        )

    def __setattr__(self, key: str, val: object) -> None:
        super().__setattr__(key, val)
        if key != "_calls":  # a tensor or setting replaced: gather the fused ops' arguments again
            object.__setattr__(self, "_calls", None)

    def __setitem__(self, key: str, val: object) -> None:  # Module.update replaces tensors as items
        super().__setitem__(key, val)
        object.__setattr__(self, "_calls", None)

    def norm(self, x: mx.array, weight: mx.array) -> mx.array:
        return self._norm(x, weight)

    def attention(self, x: mx.array, step: KVStep, rotations: Rotations, positions: mx.array) -> mx.array:
        """x [T, hidden] normed; rotations: theta -> (cos, sin) [T, 1, head_dim]; positions int32 [T].
        Writes the layer's K/V through ``step``; -> [T, hidden]."""
        cfg = self._cfg
        t = x.shape[0]
        qkv = self.qkv(x)
        # q and k heads side by side in one RoPE pass: [T, q_heads + kv_heads, D]
        qk = qkv[:, : self._split[1]].reshape(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        if "q_norm" in self:  # QK-norm: RMS over each head's dimension, before RoPE
            q = self._norm(qk[:, : cfg.num_heads], self.q_norm)
            k = self._norm(qk[:, cfg.num_heads :], self.k_norm)
            qk = mx.concatenate([q, k], axis=1)
        qk = fast_math.rope(qk, *rotations[self.rope_theta], cfg.rope_traditional)
        q = qk[:, : cfg.num_heads, None, :]  # [T, q_heads, 1, D]
        k = qk[:, cfg.num_heads :]
        v = qkv[:, self._split[1] :].reshape(t, cfg.num_kv_heads, cfg.head_dim)
        views = step.views(self.index, k, v)
        if self.deterministic or (positions is not None and kernel_attention_usable(views)):
            # the compiled kernel: keys read by position from every part, half-precision K/V as stored,
            # batch-invariant (deterministic mode requires it; elsewhere it is the fastest path)
            o = deterministic.attend(q[:, :, 0, :], views, positions, self._window, self._scale)
        else:
            o = attend(q, views, t, self._scale, self.index)
        return self.o(o)

    def mlp(self, x: mx.array) -> mx.array:
        """x: [T, hidden] (normed) -> [T, hidden]."""
        g, u = mx.split(self.gate_up(x), 2, axis=-1)
        return self.down(self._act(g, u))


def _fusion(layer: DecoderLayer):
    """The kernels module when ``layer`` can run :meth:`DecoderLayer.fused` here, else None."""
    ext = kernels()
    if ext is None or not _ON_CPU or not hasattr(ext, "fused_qkv") or "attn_norm" not in layer:
        return None
    projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
    if not all(isinstance(p, Projection) and p.block for p in projections):
        return None
    return ext


def _fused(
    tensors: Mapping[str, Tensor], prefix: str, names: tuple[str, ...], fused: str, weights_dtype: str
) -> Projection | SplitProjection:
    """The fused projection ``prefix + fused`` if stored fused, else of its stored parts ``names``."""
    if prefix + fused in tensors:
        bias = tensors.get(prefix + fused + "_bias")
        return Projection(convert(tensors[prefix + fused], weights_dtype), bias)
    parts = [convert(tensors[prefix + n], weights_dtype) for n in names]
    biases = [tensors.get(prefix + n + "_bias") for n in names]
    if any(b is not None for b in biases):
        if any(b is None for b in biases):
            raise ValueError(f"{prefix}: bias given for some of {names} only")
        return fused_projection(parts, biases)
    return fused_projection(parts)
