"""Projections ``y = x @ W.T (+ b)`` over any weight format, and converting a matrix to a resolved
``weights_dtype``."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine_service.model.cpu_kernels import kernel_max_rows
from engine_service.model.formats.block_quant import (
    BLOCK_FORMATS,
    BlockQuantTensor,
    block_matmul,
    concat_block_rows,
    to_affine,
    to_block_format,
)
from engine_service.model.formats.weights import QuantTensor, concat_rows, convert_matrix, gpu_available

Tensor = mx.array | QuantTensor | BlockQuantTensor

# weights_dtype asking every matrix to keep its source's block format (q8_0 / q4_1) where that is exact,
# and q8_0 otherwise (what ``auto`` means on the CPU with the compiled kernels)
NATIVE = "native"
# rows from which a quantized projection on the CPU dequantizes and uses BLAS instead
_DEQUANT_MIN_ROWS = 16
_ON_CPU = not gpu_available()


def convert(tensor: Tensor, weights_dtype: str) -> Tensor:
    """A matrix in the resolved ``weights_dtype`` (``native``: a block source stays, else q8_0); the block
    formats become MLX's own 8-/4-bit quantization on a GPU."""
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
    """The block format holding ``tensor`` without loss: its own, q4_1 for MLX 4-bit group 32, else q8_0."""
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
        """(wq, scales, mins) for the fused kernel ops; None unless block-quantized."""
        if not self.block:
            return None
        return self.tensor.wq, self.tensor.scales, self.tensor.mins

    def _matmul(self, x: mx.array) -> mx.array:
        if self.block:
            # a long prefill block on AVX2: the panel GEMM (kernels/src/gemm.h), ~2x the dot-product
            # kernels from 128 rows, BLAS's speed without a float32 copy of the weights
            panel = _ON_CPU and not self.kernel_only and x.shape[0] > kernel_max_rows()
            return block_matmul(x, self.tensor, panel=panel)
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
    """Projections of one input, outputs concatenated (fused parts in different block formats)."""

    def __init__(self, parts: list[Projection]) -> None:
        super().__init__()
        self.parts = parts
        self.format = "+".join(sorted({p.format for p in parts}))

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([p(x) for p in self.parts], axis=-1)


def fused_projection(parts: list[Tensor], bias: list[mx.array] | None = None) -> Projection | SplitProjection:
    """``parts`` stacked along the output (one matmul) when their formats agree, else a SplitProjection."""
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
