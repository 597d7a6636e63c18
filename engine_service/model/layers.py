"""The pieces every architecture builds its layers from: projections over any weight format, the
attention over the cache's views, the gated MLP, and :class:`DecoderLayer` (what an architecture's
layer subclasses: it only says in which order norms, attention and MLP compose).

Canonical tensor names of layer ``i`` (``p = "layers.i."``; shapes [out, in]):
``p.attn_norm`` [hidden]; ``p.{q,k,v}`` [heads * head_dim, hidden] or ``p.qkv`` fused (q rows, then k,
then v); ``p.{q,k,v}_bias`` [heads * head_dim] (attention bias, optional); ``p.{q,k}_norm`` [head_dim]
(QK-norm, optional); ``p.o`` [hidden, q_heads * head_dim]; ``p.post_attn_norm`` [hidden] (optional);
``p.mlp_norm`` [hidden]; ``p.{gate,up}`` [intermediate, hidden] or ``p.gate_up`` fused (gate rows first);
``p.down`` [hidden, intermediate]; ``p.post_mlp_norm`` [hidden] (optional). Norm weights multiply
(``x / rms(x) * w``): a checkpoint storing ``w - 1`` (Gemma's Hugging Face files) is shifted by its
loader.

Past 400 lines on purpose: the projections, the attention dispatch and :class:`DecoderLayer`'s fused and
unfused paths decide together which rows take the kernels (``kernel_max_rows``, deterministic mode,
``FUSED_OPS``); split apart, that one rule would be read in three modules.
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

import engine_service.model.deterministic as deterministic
import engine_service.model.fast_math as fast_math
from engine_service.cache.batch_control import KVStep, KVView
from engine_service.model.block_quant import (
    BLOCK_FORMATS,
    BlockQuantTensor,
    block_matmul,
    concat_block_rows,
    to_affine,
    to_block_format,
)
from engine_service.model.config import ModelConfig
from engine_service.model.cpu_kernels import kernel_max_rows, kernels
from engine_service.model.weights import QuantTensor, concat_rows, convert_matrix, gpu_available

Tensor = mx.array | QuantTensor | BlockQuantTensor
Rotations = Mapping[float, tuple[mx.array, mx.array]]

# weights_dtype asking every matrix to keep its source's block format (q8_0 / q4_1) where that is exact,
# and q8_0 otherwise (what ``auto`` means on the CPU with the compiled kernels)
NATIVE = "native"
# query rows per view below which MLX's fused attention is used (see fast_math for why not above)
_FUSED_SDPA_MAX_ROWS = 8
# rows from which a quantized projection on the CPU dequantizes and uses BLAS instead
_DEQUANT_MIN_ROWS = 16
_ON_CPU = not gpu_available()
# whether layers run their fused ops where they can (DecoderLayer.fuses); off: the unfused MLX ops,
# for comparisons (benchmarks, tests)
FUSED_OPS = True


def convert(tensor: Tensor, weights_dtype: str) -> Tensor:
    """A matrix in the resolved ``weights_dtype``. ``native``: a block-quantized source stays as it is,
    anything else becomes q8_0. The block formats (compiled CPU kernels) become MLX's own 8-/4-bit
    quantization on a GPU, where its quantized_matmul is the fast path."""
    if weights_dtype == NATIVE:
        weights_dtype = native_format(tensor)
    if weights_dtype in BLOCK_FORMATS:
        if not _ON_CPU:
            bits = 8 if weights_dtype == "q8_0" else 4
            if isinstance(tensor, QuantTensor) and (tensor.bits, tensor.group_size) == (bits, 32):
                return tensor
            w = tensor.dequantize() if isinstance(tensor, QuantTensor | BlockQuantTensor) else tensor
            return QuantTensor(*mx.quantize(w.astype(mx.float32), group_size=32, bits=bits), 32, bits)
        if isinstance(tensor, BlockQuantTensor):
            return (
                tensor
                if tensor.format == weights_dtype
                else to_block_format(tensor.dequantize(), weights_dtype)
            )
        return to_block_format(tensor, weights_dtype)
    if isinstance(tensor, BlockQuantTensor):
        exact = weights_dtype == "quantized" and tensor.in_features % 32 == 0
        tensor = to_affine(tensor) if exact else tensor.dequantize()
    return convert_matrix(tensor, weights_dtype)


def native_format(tensor: Tensor) -> str:
    """The block format that holds ``tensor`` without loss: its own, q4_1 for MLX 4-bit group-32
    quantization (the same blocks), else q8_0 (requantizing: lossless only for 8-bit sources)."""
    if isinstance(tensor, BlockQuantTensor):
        return tensor.format
    if isinstance(tensor, QuantTensor) and (tensor.bits, tensor.group_size) == (4, 32):
        return "q4_1"
    return "q8_0"


def weight_format(tensor: Tensor) -> str:
    """The storage format of a converted matrix: q8_0 / q4_1 / quantized / float32 / ..."""
    if isinstance(tensor, BlockQuantTensor):
        return tensor.format
    if isinstance(tensor, QuantTensor):
        return "quantized"
    return str(tensor.dtype).removeprefix("mlx.core.")


class Projection(nn.Module):
    """``y = x @ W.T (+ b)`` for a float, affine-quantized or block-quantized W [out, in]."""

    def __init__(self, tensor: Tensor, bias: mx.array | None = None) -> None:
        super().__init__()
        self.quantized = isinstance(tensor, QuantTensor)
        self.block = isinstance(tensor, BlockQuantTensor)
        self.kernel_only = False  # deterministic mode: no BLAS switch for long blocks
        self.format = weight_format(tensor)
        if isinstance(tensor, BlockQuantTensor):
            # the arrays as attributes (parameters() finds them), the tensor for calls: the same arrays
            self.weight, self.scales = tensor.wq, tensor.scales
            if tensor.mins is not None:
                self.mins = tensor.mins
            self.tensor = tensor
        elif isinstance(tensor, QuantTensor):
            self.weight, self.scales, self.biases = tensor.weight, tensor.scales, tensor.biases
            self.group_size, self.bits = tensor.group_size, tensor.bits
        else:
            self.weight = tensor
        if bias is not None:
            self.bias = bias.astype(mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        y = self._matmul(x)
        bias = self.get("bias")
        return y if bias is None else y + bias

    def fused_args(self) -> tuple[mx.array, mx.array, mx.array | None] | None:
        """(wq, scales, mins) for ``forkline_kernels.fused_linear`` / ``fused_qkv``, None when this
        projection's weights are not block-quantized."""
        if not self.block:
            return None
        return self.tensor.wq, self.tensor.scales, self.tensor.mins

    def _matmul(self, x: mx.array) -> mx.array:
        if self.block:
            if _ON_CPU and not self.kernel_only and x.shape[0] > kernel_max_rows():
                # a long prefill block on AVX2: float32 tiles through BLAS beat the kernel
                # (bench_kernels.py: 512 rows ~2x faster), and dequantizing costs ~3% of the block
                return x @ self.tensor.dequantize().T
            return block_matmul(x, self.tensor)
        if self.quantized:
            if x.shape[0] >= _DEQUANT_MIN_ROWS and _ON_CPU:
                # MLX's CPU quantized matmul runs at ~2 GFLOP/s whatever the row count; for a prefill
                # block, dequantizing once and using BLAS float32 is ~20x faster.
                w = mx.dequantize(self.weight, self.scales, self.biases, self.group_size, self.bits)
                return x @ w.astype(x.dtype).T
            return mx.quantized_matmul(
                x,
                self.weight,
                self.scales,
                self.biases,
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
            )
        return x @ self.weight.T

    def rows(self, ids: mx.array) -> mx.array:
        """Rows ``ids`` of W as float32 (the embedding lookup of a tied head)."""
        if self.block:
            return self.tensor.rows(ids)
        if self.quantized:
            return mx.dequantize(
                self.weight[ids], self.scales[ids], self.biases[ids], self.group_size, self.bits
            ).astype(mx.float32)
        return self.weight[ids].astype(mx.float32)


class SplitProjection(nn.Module):
    """Several projections of one input whose outputs are concatenated (a fused q/k/v or gate/up whose
    parts keep different block formats, so no single kernel call can read them)."""

    def __init__(self, parts: list[Projection]) -> None:
        super().__init__()
        self.parts = parts
        self.format = "+".join(sorted({p.format for p in parts}))

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([p(x) for p in self.parts], axis=-1)


def fused_projection(parts: list[Tensor], bias: list[mx.array] | None = None) -> Projection | SplitProjection:
    """One projection of ``parts`` stacked along the output dimension (one matmul for q/k/v, gate/up)
    when their formats agree; otherwise a :class:`SplitProjection`."""
    b = mx.concatenate([x.astype(mx.float32) for x in bias]) if bias else None
    if all(isinstance(p, BlockQuantTensor) for p in parts):
        if len({p.format for p in parts}) == 1:
            return Projection(concat_block_rows(parts), b)
        sizes = [p.shape[0] for p in parts]
        biases = [None] * len(parts) if b is None else mx.split(b, list(_cumsum(sizes[:-1])))
        return SplitProjection([Projection(p, pb) for p, pb in zip(parts, biases, strict=True)])
    return Projection(concat_rows(parts), b)


def _cumsum(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for s in sizes:
        total += s
        out.append(total)
    return out


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
    from dataclasses import replace

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


ACTIVATIONS = {"silu": fast_math.silu_mul, "gelu_tanh": fast_math.gelu_tanh_mul}


class DecoderLayer(nn.Module):
    """Attention + gated MLP of one layer, from the canonical tensors (module docstring). Subclasses
    write ``__call__(h, step, rotations, positions)`` from :meth:`attention`, :meth:`mlp` and
    :meth:`norm`; options: ``activation`` (``silu``: SwiGLU, ``gelu_tanh``: GeGLU), optional tensors
    (bias, QK-norm, post norms) are used when present.
    """

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
        """Whether a forward of ``rows`` packed rows runs the fused ops (:meth:`fused`): the compiled
        kernels with ``fused_linear`` on a CPU stream, block-quantized q/k/v, o, gate/up and down in one
        format each, and at most :func:`kernel_max_rows` rows -- any row count in deterministic mode, so
        every row of a model takes the same path whatever its forward's shape."""
        return (
            FUSED_OPS
            and self._fusion is not None
            and (self.deterministic or rows <= kernel_max_rows())
            and mx.default_device() == mx.cpu
        )

    def fused(self, h: mx.array, step: KVStep, rotations: Rotations, positions: mx.array) -> mx.array:
        """The layer as five fused ops (``forkline_kernels.fused_qkv`` / ``fused_linear``, the attention
        kernel between): ``h += post_attn_norm?(o(attn(attn_norm(h))))``, then
        ``h += post_mlp_norm?(down(act(gate(x)) * up(x)))`` with ``x = mlp_norm(h)``; the optional norms
        are those the layer has (Llama: none, Gemma 3: both). Row-local like the unfused ops, so the
        same batch invariance."""
        ext, eps = self._fusion, self._norm.eps
        cfg = self._cfg
        t = h.shape[0]
        qkv, o, gate_up, down = self.qkv, self.o, self.gate_up, self.down
        cos, sin = rotations[self.rope_theta]
        q, k, v = ext.fused_qkv(
            h,
            *qkv.fused_args(),
            q_heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            norm=self.attn_norm,
            eps=eps,
            bias=qkv.get("bias"),
            q_norm=self.get("q_norm"),
            k_norm=self.get("k_norm"),
            qk_eps=eps,
            cos=cos,
            sin=sin,
            traditional=cfg.rope_traditional,
            kv_dtype=self.kv_hint[0],
        )
        views = step.views(self.index, k, v)
        first = views[0].parts[0] if views[0].parts is not None else views[0]
        if first.keys.dtype != self.kv_hint[0]:
            self.kv_hint[0] = first.keys.dtype
        if self.deterministic or (positions is not None and kernel_attention_usable(views)):
            a = deterministic.attend(q, views, positions, self._window, self._scale)
        else:
            a = attend(q[:, :, None, :], views, t, self._scale, self.index)
        h = ext.fused_linear(
            a,
            *o.fused_args(),
            bias=o.get("bias"),
            post_norm=self.get("post_attn_norm"),
            post_eps=eps,
            residual=h,
        )
        m = ext.fused_linear(
            h,
            *gate_up.fused_args(),
            norm=self.mlp_norm,
            eps=eps,
            bias=gate_up.get("bias"),
            act=self._activation,
        )
        return ext.fused_linear(
            m,
            *down.fused_args(),
            bias=down.get("bias"),
            post_norm=self.get("post_mlp_norm"),
            post_eps=eps,
            residual=h,
        )

    def norm(self, x: mx.array, weight: mx.array) -> mx.array:
        return self._norm(x, weight)

    def attention(self, x: mx.array, step: KVStep, rotations: Rotations, positions: mx.array) -> mx.array:
        """x: [T, hidden] (normed); rotations: theta -> RoPE tables (cos, sin) [T, 1, head_dim];
        positions: int32 [T]. Writes this layer's K/V through ``step``; returns [T, hidden]."""
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
