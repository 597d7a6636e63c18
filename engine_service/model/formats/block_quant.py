"""Block-quantized matrices for the compiled CPU kernels, 32 weights a block along the (zero-padded) input:
``q8_0`` wq int8 [N, Kp], scales float32 [N, Kp/32], w = scale * q; ``q4_1`` wq uint8 [N, Kp/2] (byte
i = q[i] | q[i + 16] << 4), scales, mins [N, Kp/32], w = scale * q + min. Spec: docs/MODELS.md."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine_service.api.errors import InvalidArgument
from engine_service.model.cpu_kernels import kernels
from engine_service.model.formats.weights import QuantTensor

BLOCK = 32
BLOCK_FORMATS = ("q8_0", "q4_1")


@dataclass(frozen=True)
class BlockQuantTensor:
    """A [N, in_features] matrix in ``format`` (arrays as the module docstring says)."""

    format: str
    wq: mx.array
    scales: mx.array
    mins: mx.array | None
    in_features: int

    def __post_init__(self) -> None:
        if self.format not in BLOCK_FORMATS:
            raise InvalidArgument(
                f"BlockQuantTensor.format must be one of {BLOCK_FORMATS}, got {self.format!r}"
            )
        n, blocks = self.scales.shape
        per_block = BLOCK if self.format == "q8_0" else BLOCK // 2
        if self.wq.shape != (n, blocks * per_block):
            raise InvalidArgument(
                f"BlockQuantTensor.wq {self.wq.shape} does not match scales {self.scales.shape}"
            )
        if not blocks * BLOCK - BLOCK < self.in_features <= blocks * BLOCK:
            raise InvalidArgument(
                f"BlockQuantTensor.in_features {self.in_features} does not fit {blocks} blocks"
            )
        if (self.mins is None) != (self.format == "q8_0"):
            raise InvalidArgument("BlockQuantTensor.mins must be given for q4_1 only")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.scales.shape[0], self.in_features)

    @property
    def nbytes(self) -> int:
        return self.wq.nbytes + self.scales.nbytes + (self.mins.nbytes if self.mins is not None else 0)

    def dequantize(self) -> mx.array:
        """float32 [N, in_features]."""
        return _dequantize(self, self.wq, self.scales, self.mins)

    def rows(self, ids: mx.array) -> mx.array:
        """Dequantized rows ``ids`` (an embedding lookup): float32 [len(ids), in_features]."""
        mins = self.mins[ids] if self.mins is not None else None
        return _dequantize(self, self.wq[ids], self.scales[ids], mins)


def _dequantize(t: BlockQuantTensor, wq: mx.array, scales: mx.array, mins: mx.array | None) -> mx.array:
    n, blocks = scales.shape
    if t.format == "q8_0":
        q = wq.reshape(n, blocks, BLOCK).astype(mx.float32)
        w = q * scales[..., None]
    else:
        packed = wq.reshape(n, blocks, BLOCK // 2)
        q = mx.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(mx.float32)
        w = q * scales[..., None] + mins[..., None]
    return w.reshape(n, blocks * BLOCK)[:, : t.in_features]


def _padded_blocks(w: mx.array) -> mx.array:
    """float32 [N, K] -> [N, ceil(K/32), 32], zero-padded."""
    n, k = w.shape
    pad = -k % BLOCK
    if pad:
        w = mx.concatenate([w, mx.zeros((n, pad), dtype=w.dtype)], axis=1)
    return w.reshape(n, -1, BLOCK)


def is_block_dtype(weights_dtype: str) -> bool:
    """Whether a resolved weights dtype is block formats only (``q8_0``, ``q4_1``, ``q4_1+q8_0``)."""
    return bool(weights_dtype) and all(part in BLOCK_FORMATS for part in weights_dtype.split("+"))


def to_q8_0(tensor: mx.array | QuantTensor) -> BlockQuantTensor:
    """Quantize a float matrix (or dequantize and requantize an MLX-quantized one) to q8_0."""
    w = tensor.dequantize() if isinstance(tensor, QuantTensor) else tensor.astype(mx.float32)
    if w.ndim != 2:
        raise InvalidArgument(f"to_q8_0 takes a 2-D matrix, got shape {w.shape}")
    blocks = _padded_blocks(w)
    scales = mx.max(mx.abs(blocks), axis=-1) / 127.0
    safe = mx.where(scales > 0, scales, 1.0)
    q = mx.clip(mx.round(blocks / safe[..., None]), -127, 127).astype(mx.int8)
    return BlockQuantTensor("q8_0", q.reshape(w.shape[0], -1), scales, None, w.shape[1])


def to_q4_1(tensor: mx.array | QuantTensor) -> BlockQuantTensor:
    """q4_1 from a 4-bit group-32 QuantTensor (exact) or a float matrix; other QuantTensors dequantized."""
    if isinstance(tensor, QuantTensor) and not (tensor.bits == 4 and tensor.group_size == BLOCK):
        tensor = tensor.dequantize()
    if isinstance(tensor, QuantTensor):
        in_features = tensor.shape[1]
        packed, scales, mins = tensor.weight, tensor.scales, tensor.biases
    else:
        if tensor.ndim != 2:
            raise InvalidArgument(f"to_q4_1 takes a 2-D matrix, got shape {tensor.shape}")
        in_features = tensor.shape[1]
        blocks = _padded_blocks(tensor.astype(mx.float32))
        packed, scales, mins = mx.quantize(blocks.reshape(tensor.shape[0], -1), group_size=BLOCK, bits=4)
    n = packed.shape[0]
    # MLX packs 8 weights per uint32, weight j in bits 4j..4j+3: little-endian bytes hold weights
    # (2i, 2i+1) in their (low, high) nibbles.
    nibbles = packed.view(mx.uint8).reshape(n, -1, 1)
    q = mx.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, -1, BLOCK)
    wq = (q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)).astype(mx.uint8)
    return BlockQuantTensor(
        "q4_1", wq.reshape(n, -1), scales.astype(mx.float32), mins.astype(mx.float32), in_features
    )


def to_affine(t: BlockQuantTensor) -> QuantTensor:
    """The same values as MLX affine quantization, group 32 (exact); K a multiple of 32."""
    n, blocks = t.scales.shape
    if t.in_features != blocks * BLOCK:
        raise InvalidArgument(f"to_affine needs in_features a multiple of {BLOCK}, got {t.in_features}")
    if t.format == "q8_0":
        u = (t.wq.astype(mx.int16) + 128).astype(mx.uint8)  # [N, K]
        return QuantTensor(u.view(mx.uint32), t.scales, t.scales * -128.0, BLOCK, 8)
    packed = t.wq.reshape(n, blocks, BLOCK // 2)
    q = mx.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1, 2)  # weights in order
    nibbles = (q[..., 0] | (q[..., 1] << 4)).astype(mx.uint8)  # byte k: weights 2k (low), 2k + 1
    return QuantTensor(nibbles.reshape(n, -1).view(mx.uint32), t.scales, t.mins, BLOCK, 4)


def to_block_format(tensor: mx.array | QuantTensor, fmt: str) -> BlockQuantTensor:
    if fmt == "q8_0":
        return to_q8_0(tensor)
    if fmt == "q4_1":
        return to_q4_1(tensor)
    raise InvalidArgument(f"block format must be one of {BLOCK_FORMATS}, got {fmt!r}")


def block_matmul(x: mx.array, t: BlockQuantTensor, panel: bool = False) -> mx.array:
    """``x @ W.T``: x float [..., in_features] -> float32 [..., N]; ``panel``: the panel GEMM (long
    blocks; its own summation order, kernels/src/gemm.h) instead of the dot-product kernels."""
    ext = kernels()
    if ext is not None and mx.default_device() == mx.cpu:  # float activations: see kernels/src/qdot.h
        if t.format == "q8_0":
            return ext.q8_0_matmul(x, t.wq, t.scales, panel=panel)
        return ext.q4_1_matmul(x, t.wq, t.scales, t.mins, panel=panel)
    return x.astype(mx.float32) @ t.dequantize().T


def concat_block_rows(parts: list[BlockQuantTensor]) -> BlockQuantTensor:
    """Matrices of one format and width stacked along the output (one kernel call for q/k/v)."""
    first = parts[0]
    if any(p.format != first.format or p.in_features != first.in_features for p in parts):
        raise InvalidArgument("concat_block_rows: parts must share format and in_features")
    mins = None if first.mins is None else mx.concatenate([p.mins for p in parts])
    return BlockQuantTensor(
        first.format,
        mx.concatenate([p.wq for p in parts]),
        mx.concatenate([p.scales for p in parts]),
        mins,
        first.in_features,
    )
