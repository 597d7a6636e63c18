"""A Llama-family decoder that reads and writes K/V only through a :class:`KVStep`.

Canonical tensor names (what loaders produce; ``i`` is the layer index, shapes [out, in]):
``embed`` [vocab, hidden]; ``layers.i.attn_norm`` [hidden]; ``layers.i.{q,k,v}`` [heads * head_dim,
hidden]; ``layers.i.o`` [hidden, q_heads * head_dim]; ``layers.i.mlp_norm`` [hidden];
``layers.i.{gate,up}`` [intermediate, hidden]; ``layers.i.down`` [hidden, intermediate]; ``norm``
[hidden]; ``lm_head`` [vocab, hidden] (absent when the head is tied to ``embed``).

One forward carries several sequences' tokens packed in segment order, each at its own position.
Activations stay float32 whatever the weight dtype (MLX's CPU kernels are fastest there).
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

from engine_service.cache.batch_control import KVStep, KVView
from engine_service.model import fast_math
from engine_service.model.block_quant import (
    BLOCK_FORMATS,
    BlockQuantTensor,
    block_matmul,
    concat_block_rows,
    to_block_format,
)
from engine_service.model.config import ModelConfig
from engine_service.model.weights import QuantTensor, concat_rows, convert_matrix, gpu_available

Tensor = mx.array | QuantTensor | BlockQuantTensor

# query rows per view below which MLX's fused attention is used (see fast_math for why not above)
_FUSED_SDPA_MAX_ROWS = 8
# rows from which a quantized projection on the CPU dequantizes and uses BLAS instead
_DEQUANT_MIN_ROWS = 16
# rows up to which block-quantized weights go through the compiled kernels (batch-invariant: a row
# alone, in a decode batch or in a short prefix-hit suffix gets the same bits); above, BLAS
_KERNEL_MAX_ROWS = 64
_ON_CPU = not gpu_available()


def convert(tensor: mx.array | QuantTensor, weights_dtype: str) -> Tensor:
    """A matrix in the resolved ``weights_dtype``. The block formats (compiled CPU kernels) become
    MLX's own 8-/4-bit quantization on a GPU, where its quantized_matmul is the fast path."""
    if weights_dtype in BLOCK_FORMATS:
        if not _ON_CPU:
            bits = 8 if weights_dtype == "q8_0" else 4
            if isinstance(tensor, QuantTensor) and (tensor.bits, tensor.group_size) == (bits, 32):
                return tensor
            w = tensor.dequantize() if isinstance(tensor, QuantTensor) else tensor.astype(mx.float32)
            return QuantTensor(*mx.quantize(w, group_size=32, bits=bits), 32, bits)
        return to_block_format(tensor, weights_dtype)
    return convert_matrix(tensor, weights_dtype)


def fuse_rows(parts: list[Tensor]) -> Tensor:
    """One matrix of ``parts`` stacked along the output dimension (one matmul for q/k/v, gate/up)."""
    if all(isinstance(p, BlockQuantTensor) for p in parts):
        return concat_block_rows(parts)
    return concat_rows(parts)


class Projection(nn.Module):
    """``y = x @ W.T`` for a float, affine-quantized or block-quantized W [out, in]."""

    def __init__(self, tensor: Tensor) -> None:
        super().__init__()
        self.quantized = isinstance(tensor, QuantTensor)
        self.block = isinstance(tensor, BlockQuantTensor)
        self.kernel_only = False  # deterministic mode: no BLAS switch for long blocks
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

    def __call__(self, x: mx.array) -> mx.array:
        if self.block:
            if x.shape[0] > _KERNEL_MAX_ROWS and _ON_CPU and not self.kernel_only:
                # a long prefill block: float32 tiles through BLAS beat the kernel (bench_kernels.py:
                # 512 rows ~2x faster), and dequantizing costs ~3% of the block
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


class Block(nn.Module):
    """Pre-norm attention + SwiGLU MLP. Q/K/V and gate/up are fused into one matmul each."""

    def __init__(
        self, config: ModelConfig, index: int, tensors: Mapping[str, Tensor], weights_dtype: str
    ) -> None:
        super().__init__()
        p = f"layers.{index}."
        self.index = index
        self.attn_norm = tensors[p + "attn_norm"].astype(mx.float32)
        self.mlp_norm = tensors[p + "mlp_norm"].astype(mx.float32)
        conv = [convert(tensors[p + n], weights_dtype) for n in ("q", "k", "v")]
        self.qkv = Projection(fuse_rows(conv))
        self.o = Projection(convert(tensors[p + "o"], weights_dtype))
        self.gate_up = Projection(fuse_rows([convert(tensors[p + n], weights_dtype) for n in ("gate", "up")]))
        self.down = Projection(convert(tensors[p + "down"], weights_dtype))
        self._cfg = config
        self._split = (config.q_size, config.q_size + config.kv_size)
        self._scale = config.head_dim**-0.5
        self._norm = fast_math.rms_norm(config.rms_norm_eps)
        self._window = config.layers[index].window if config.layers else None
        self.deterministic = False  # batch-invariant attention (see engine_service.model.deterministic)

    def __call__(
        self, h: mx.array, step: KVStep, rot: tuple[mx.array, mx.array], positions: mx.array | None = None
    ) -> mx.array:
        """h: [T, hidden]; rot: the forward's RoPE tables (cos, sin), each [T, 1, head_dim]; positions:
        int32 [T] (deterministic mode reads keys by absolute position)."""
        cfg = self._cfg
        t = h.shape[0]
        x = self._norm(h, self.attn_norm)
        qkv = self.qkv(x)
        # q and k heads side by side in one RoPE pass: [T, q_heads + kv_heads, D]
        qk = qkv[:, : self._split[1]].reshape(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        qk = fast_math.rope(qk, *rot, cfg.rope_traditional)
        q = qk[:, : cfg.num_heads, None, :]  # [T, q_heads, 1, D]
        k = qk[:, cfg.num_heads :]
        v = qkv[:, self._split[1] :].reshape(t, cfg.num_kv_heads, cfg.head_dim)
        views = step.views(self.index, k, v)
        if self.deterministic:
            from engine_service.model import deterministic

            o = deterministic.attend(q[:, :, 0, :], views, positions, self._window, self._scale)
        else:
            o = self._attend(q, views, t)
        h = h + self.o(o)
        x = self._norm(h, self.mlp_norm)
        g, u = mx.split(self.gate_up(x), 2, axis=-1)
        return h + self.down(fast_math.silu_mul(g, u))

    def _attend(self, q: mx.array, views: list[KVView], t: int) -> mx.array:
        """q: [T, q_heads, 1, D]; each view's rows attend its keys/values [kv_heads, S, D]. -> [T, q_heads * D]."""
        ordered = sorted(views, key=lambda view: view.rows.start)
        outs = []
        covered = 0
        for view in ordered:
            start, stop, stride = view.rows.indices(t)
            if start != covered or stride != 1 or stop <= start:
                raise ValueError(
                    f"layer {self.index}: KV views must cover the {t} packed rows once, in order"
                )
            covered = stop
            n = stop - start
            if view.parts is not None:  # several pool slices: one softmax across them, no gather
                qv = q[start:stop, :, 0, :].transpose(1, 0, 2)  # [q_heads, n, D]
                parts = [(p.keys, p.values, p.mask) for p in view.parts]
                o = fast_math.attention_parts(qv, parts, self._scale)
                outs.append(o.transpose(1, 0, 2).reshape(n, -1))
                continue
            if n == 1:  # a decode row is already [1, q_heads, 1, D], sdpa's [B, H, L, D]: no transposes
                o = mx.fast.scaled_dot_product_attention(
                    q[start:stop], view.keys[None], view.values[None], scale=self._scale, mask=view.mask
                )
                outs.append(o.reshape(1, -1))
                continue
            qv = q[start:stop, :, 0, :].transpose(1, 0, 2)  # [q_heads, n, D]
            if n < _FUSED_SDPA_MAX_ROWS:  # a few rows: one fused op; few exponentials to compute
                o = mx.fast.scaled_dot_product_attention(
                    qv[None], view.keys[None], view.values[None], scale=self._scale, mask=view.mask
                )[0]
            else:  # prefill: BLAS matmuls + the fast softmax (MLX's CPU exp dominates otherwise)
                o = fast_math.attention(qv, view.keys, view.values, self._scale, view.mask)
            outs.append(o.transpose(1, 0, 2).reshape(n, -1))
        if covered != t:
            raise ValueError(f"layer {self.index}: KV views cover {covered} of {t} packed rows")
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)


class Transformer(nn.Module):
    """The decoder. See the module docstring for tensor names and the packing contract."""

    def __init__(
        self, config: ModelConfig, tensors: Mapping[str, Tensor], weights_dtype: str = "float32"
    ) -> None:
        super().__init__()
        if weights_dtype == "auto":
            raise ValueError(
                "Transformer needs a resolved weights_dtype (float32/float16/bfloat16/quantized/q8_0/q4_1)"
            )
        self._config = config
        self.weights_dtype = weights_dtype
        # the embedding (and a tied head) stays 8-bit under q4_1, as GGUF's 4-bit files keep it (4 bits
        # there costs far more accuracy than in the layers)
        head_dtype = "q8_0" if weights_dtype == "q4_1" else weights_dtype
        self.embed_tokens = Projection(convert(tensors["embed"], head_dtype))
        self.layers = [Block(config, i, tensors, weights_dtype) for i in range(config.num_layers)]
        self.norm = tensors["norm"].astype(mx.float32)
        if config.tie_embeddings or "lm_head" not in tensors:
            self.lm_head = None
        else:
            self.lm_head = Projection(convert(tensors["lm_head"], head_dtype))

    @property
    def config(self) -> ModelConfig:
        return self._config

    @property
    def deterministic(self) -> bool:
        return self.layers[0].deterministic if self.layers else False

    def set_deterministic(self, on: bool) -> None:
        """Batch-invariant forwards (see :mod:`engine_service.model.deterministic`): FailedPrecondition
        when the compiled kernels are missing or the weights are not block-quantized."""
        if on:
            from engine_service.model import deterministic

            deterministic.require(self.weights_dtype)
        for layer in self.layers:
            layer.deterministic = on
        for proj in self.modules():
            if isinstance(proj, Projection):
                proj.kernel_only = on  # every row count through the batch-invariant kernel

    def embed(self, tokens: mx.array) -> mx.array:
        """tokens: int32 [T] -> float32 [T, hidden]."""
        return self.embed_tokens.rows(tokens)

    def __call__(
        self,
        step: KVStep,
        positions: mx.array,
        *,
        tokens: mx.array | None = None,
        embeddings: mx.array | None = None,
        logit_rows: mx.array | None = None,
    ) -> mx.array:
        """One packed forward.

        positions: int32 [T], each packed row's position in its own sequence (segment order).
        tokens: int32 [T] or embeddings: float [T, hidden] (exactly one).
        logit_rows: int32 [R] packed rows to project (None: all rows). Returns float32 [R or T, vocab].
        """
        if (tokens is None) == (embeddings is None):
            raise ValueError("Transformer needs exactly one of tokens / embeddings")
        h = self.embed(tokens) if tokens is not None else embeddings.astype(mx.float32)
        if h.ndim != 2 or h.shape[1] != self._config.hidden_size:
            raise ValueError(f"embeddings must be [T, {self._config.hidden_size}], got {h.shape}")
        if positions.shape != (h.shape[0],):
            raise ValueError(f"positions must be [{h.shape[0]}], got {positions.shape}")
        rot = fast_math.rope_tables(
            positions, self._config.head_dim, self._config.rope_theta, self._config.rope_traditional
        )
        for layer in self.layers:
            h = layer(h, step, rot, positions)
        if logit_rows is not None:
            h = h[logit_rows]
        h = fast_math.rms_norm(self._config.rms_norm_eps)(h, self.norm)
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        return head(h).astype(mx.float32)
