"""ggml tensor types (a row is blocks of ``elements`` weights in ``nbytes`` bytes; layouts from ggml's
``ggml-common.h``, no code copied): decoders to float32 and exact 32-weight block forms."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_service.api.checks import checked_int
from engine_service.api.errors import InvalidArgument


@dataclass(frozen=True)
class BlockType:
    """A ggml tensor type: ``elements`` weights in ``nbytes`` bytes per block."""

    type_id: int
    name: str
    elements: int
    nbytes: int


BLOCK_TYPES: dict[int, BlockType] = {
    b.type_id: b
    for b in (
        BlockType(0, "F32", 1, 4),
        BlockType(1, "F16", 1, 2),
        BlockType(2, "Q4_0", 32, 18),
        BlockType(3, "Q4_1", 32, 20),
        BlockType(6, "Q5_0", 32, 22),
        BlockType(7, "Q5_1", 32, 24),
        BlockType(8, "Q8_0", 32, 34),
        BlockType(12, "Q4_K", 256, 144),
        BlockType(13, "Q5_K", 256, 176),
        BlockType(14, "Q6_K", 256, 210),
        BlockType(30, "BF16", 1, 2),
    )
}

BLOCK_BY_NAME: dict[str, BlockType] = {b.name: b for b in BLOCK_TYPES.values()}

EXACT_FORMAT: dict[str, str] = {
    "Q8_0": "q8_0",
    "Q5_0": "q8_0",
    "Q4_0": "q4_1",
    "Q4_1": "q4_1",
    "Q4_K": "q4_1",
}
"""Types that :func:`exact_blocks32` converts without loss, and the kernel format (``block_quant``) their
:class:`Blocks32` fits: ``q8_0`` = symmetric int8, ``q4_1`` = affine 4-bit. The others (F32, F16, BF16,
Q5_1, Q5_K, Q6_K) must be requantized from :func:`dequantize`."""

_F16 = np.dtype("<f2")
_CHUNK_WEIGHTS = 1 << 18  # weights decoded per step: keeps the temporaries in cache


def _check(block: BlockType, data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, int, int]:
    """Validate the arguments; (the blocks as uint8 [rows * cols / elements, nbytes], rows, cols)."""
    if not isinstance(block, BlockType) or BLOCK_TYPES.get(block.type_id) != block:
        raise InvalidArgument(f"unknown ggml block type {block!r}")
    name = block.name
    rows, cols = (
        checked_int(f"{name} tensor rows", rows, lo=1),
        checked_int(f"{name} tensor cols", cols, lo=1),
    )
    if cols % block.elements:
        raise InvalidArgument(
            f"{name} tensor [{rows}, {cols}]: cols {cols} is not a multiple of the "
            f"block size {block.elements}"
        )
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        what = (
            f"{data.dtype} array of shape {data.shape}"
            if isinstance(data, np.ndarray)
            else type(data).__name__
        )
        raise InvalidArgument(f"{name} tensor [{rows}, {cols}]: data must be a 1-D uint8 array, got a {what}")
    n_blocks = rows * (cols // block.elements)
    expected = n_blocks * block.nbytes
    if data.size != expected:
        raise InvalidArgument(
            f"{name} tensor [{rows}, {cols}]: expected {expected} bytes "
            f"({n_blocks} blocks of {block.nbytes} bytes for {block.elements} weights), got {data.size}"
        )
    return np.ascontiguousarray(data).reshape(n_blocks, block.nbytes), rows, cols


def _f16(b: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte ``offset`` of every block, as float32 [n, 1]."""
    return b[:, offset : offset + 2].view(_F16).astype(np.float32)


# [n, k] bytes -> [n, 2k]: all low nibbles, then all high ones (32-weight blocks, K types' 64-chunks)
def _nibbles(qs: np.ndarray) -> np.ndarray:
    n, k = qs.shape
    out = np.empty((n, 2, k), np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[:, 0])
    np.right_shift(qs, 4, out=out[:, 1])
    return out.reshape(n, 2 * k)


# Q5_0/Q5_1 q [n, 32] in [0, 31]: bit j of the little-endian uint32 qh is weight j's fifth bit, the low
# 4 bits are the nibbles of the 16 bytes after qh
def _q5_32(b: np.ndarray, qh_at: int) -> np.ndarray:
    high = np.unpackbits(b[:, qh_at : qh_at + 4], axis=1, bitorder="little")
    q = _nibbles(b[:, qh_at + 4 : qh_at + 20])
    q |= high << 4
    return q


# Q4_K/Q5_K's 12 scale bytes -> (sc, m) uint8 [n, 8] of 6 bits (ggml's get_scale_min_k4): sub-blocks
# 0-3 the low 6 bits of bytes 0-3 (sc) / 4-7 (m); 4-7 the nibbles of bytes 8-11 (sc low, m high) with
# the top 2 bits of bytes 0-3 (sc) / 4-7 (m) above them
def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = s.shape[0]
    sc = np.empty((n, 8), np.uint8)
    m = np.empty((n, 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 0x3F
    m[:, :4] = s[:, 4:8] & 0x3F
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    m[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, m


# Q4_K/Q5_K's 128 quant bytes -> q [n, 256]: chunk c of 64 weights from bytes 32c..32c+31, weight
# 64c + l the low nibble of byte 32c + l, 64c + 32 + l its high one
def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    n = qs.shape[0]
    return _nibbles(qs.reshape(n * 4, 32)).reshape(n, 256)


def _k_params(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K per-32 parameters: (d * sc, dmin * m) float32 [n, 8] (ggml's d1/m1, exact products)."""
    sc, m = _k_scales(b[:, 4:16])
    return _f16(b, 0) * sc.astype(np.float32), _f16(b, 2) * m.astype(np.float32)


# --- per-type decoders: blocks uint8 [n, nbytes] -> write float32 [n, elements] into `out` --------------
#
# Byte layouts (little-endian; f16 = IEEE half):
#   Q8_0  (34 B / 32): f16 d | 32 x int8 q.                                         y = q * d
#   Q4_0  (18 B / 32): f16 d | 16 B qs: byte j = q[j] low nibble, q[j+16] high.   y = (q - 8) * d
#   Q4_1  (20 B / 32): f16 d | f16 m | 16 B qs as Q4_0.                            y = q * d + m
#   Q5_0  (22 B / 32): f16 d | u32 qh (bit j = bit 4 of q[j]) | 16 B qs (low 4 bits as Q4_0).
#                                                                                  y = (q - 16) * d
#   Q5_1  (24 B / 32): f16 d | f16 m | u32 qh | 16 B qs as Q5_0.                   y = q * d + m
#   Q4_K  (144 B / 256): f16 d | f16 dmin | 12 B packed 6-bit (sc, m) for 8 sub-blocks of 32 (_k_scales)
#         | 128 B qs (_k_nibbles).          sub-block j: d1 = d * sc[j], m1 = dmin * m[j]; y = d1 * q - m1
#   Q5_K  (176 B / 256): f16 d | f16 dmin | 12 B scales as Q4_K | 32 B qh | 128 B qs as Q4_K; the fifth
#         bit of weight 64c + l is bit 2c of qh[l], of weight 64c + 32 + l bit 2c + 1.   y as Q4_K
#   Q6_K  (210 B / 256): 128 B ql | 64 B qh | 16 x int8 scales (one per 16 weights) | f16 d. Two halves
#         of 128 weights, half h using ql[64h:64h+64] and qh[32h:32h+32]; for l < 32 the weights
#         128h + l + 32k (k = 0..3) take their low 4 bits from the low nibble of ql[l] (k=0), of ql[l+32]
#         (k=1), the high nibble of ql[l] (k=2), of ql[l+32] (k=3), and their top 2 bits from bits 2k, 2k+1
#         of qh[l].                                          y = d * scales[i // 16] * (q - 32)
#   F32 / F16 / BF16: one little-endian value per weight (BF16: the top 16 bits of a float32).


def _dq_q8_0(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(b[:, 2:34].view(np.int8), _f16(b, 0), out=out, dtype=np.float32)


def _dq_q4_0(b: np.ndarray, out: np.ndarray) -> None:
    q = _nibbles(b[:, 2:18]).view(np.int8)
    q -= 8
    np.multiply(q, _f16(b, 0), out=out, dtype=np.float32)


def _dq_q4_1(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_nibbles(b[:, 4:20]), _f16(b, 0), out=out, dtype=np.float32)
    out += _f16(b, 2)


def _dq_q5_0(b: np.ndarray, out: np.ndarray) -> None:
    q = _q5_32(b, 2).view(np.int8)
    q -= 16
    np.multiply(q, _f16(b, 0), out=out, dtype=np.float32)


def _dq_q5_1(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_q5_32(b, 4), _f16(b, 0), out=out, dtype=np.float32)
    out += _f16(b, 2)


def _dq_k_affine(q: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    d1, m1 = _k_params(b)
    o = out.reshape(n, 8, 32)
    np.multiply(q.reshape(n, 8, 32), d1[:, :, None], out=o, dtype=np.float32)
    o -= m1[:, :, None]


def _dq_q4_k(b: np.ndarray, out: np.ndarray) -> None:
    _dq_k_affine(_k_nibbles(b[:, 16:144]), b, out)


def _q5_k_quants(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    q = _k_nibbles(b[:, 48:176]).reshape(n, 8, 32)
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 2c + half, l]
    q |= high << 4
    return q


def _dq_q5_k(b: np.ndarray, out: np.ndarray) -> None:
    _dq_k_affine(_q5_k_quants(b), b, out)


def _dq_q6_k(b: np.ndarray, out: np.ndarray) -> None:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n * 2, 64)
    qh = b[:, 128:192].reshape(n * 2, 1, 32)
    q = _nibbles(ql).reshape(n * 2, 4, 32)  # [half, k, l]: k = 0, 1 low nibbles of ql[l], ql[l+32]; 2, 3 high
    q |= ((qh >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]) & 3) << 4
    qs = q.view(np.int8)
    qs -= 32
    scale = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)  # d * sc, [n, 16]
    np.multiply(qs.reshape(n, 16, 16), scale[:, :, None], out=out.reshape(n, 16, 16), dtype=np.float32)


_DECODERS = {
    "Q8_0": _dq_q8_0,
    "Q4_0": _dq_q4_0,
    "Q4_1": _dq_q4_1,
    "Q5_0": _dq_q5_0,
    "Q5_1": _dq_q5_1,
    "Q4_K": _dq_q4_k,
    "Q5_K": _dq_q5_k,
    "Q6_K": _dq_q6_k,
}


def dequantize(block: BlockType, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """A tensor's bytes (uint8) -> float32 [rows, cols] as ggml computes them (same float32 operations,
    same order); InvalidArgument for a wrong type, size or dtype before reading anything."""
    b, rows, cols = _check(block, data, rows, cols)
    if block.name == "F32":
        return b.view("<f4").astype(np.float32).reshape(rows, cols)
    if block.name == "F16":
        return b.view(_F16).astype(np.float32).reshape(rows, cols)
    if block.name == "BF16":
        return (b.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(rows, cols)
    decode = _DECODERS[block.name]
    out = np.empty((b.shape[0], block.elements), np.float32)
    step = max(1, _CHUNK_WEIGHTS // block.elements)
    with np.errstate(invalid="ignore", over="ignore"):  # a NaN / inf scale decodes as ggml's would
        for start in range(0, b.shape[0], step):
            decode(b[start : start + step], out[start : start + step])
    return out.reshape(rows, cols)


@dataclass(frozen=True)
class Blocks32:
    """A matrix in 32-weight blocks with their own parameters: w = scales[r, c // 32] * q[r, c] (+ mins
    likewise when affine); q int8 (symmetric) or uint8 in [0, 15], scales / mins float32 [rows, cols // 32]."""

    q: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None

    def values(self) -> np.ndarray:
        """float32 [rows, cols] (equal to :func:`dequantize` of the tensor this came from)."""
        rows, cols = self.q.shape
        q = self.q.reshape(rows, cols // 32, 32)
        with np.errstate(invalid="ignore", over="ignore"):
            w = np.multiply(q, self.scales[:, :, None], dtype=np.float32)
            if self.mins is not None:
                w += self.mins[:, :, None]
        return w.reshape(rows, cols)


def exact_blocks32(block: BlockType, data: np.ndarray, rows: int, cols: int) -> Blocks32 | None:
    """The tensor as :class:`Blocks32` without loss for :data:`EXACT_FORMAT` (Q8_0, Q5_0 symmetric; Q4_0,
    Q4_1, Q4_K affine: Q4_K's d * sc and -(dmin * m) are exact in float32), else None."""
    b, rows, cols = _check(block, data, rows, cols)
    name = block.name
    if name not in EXACT_FORMAT:
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        q, scales, mins = _exact_parts(name, b)
    per_row = cols // 32
    return Blocks32(
        q.reshape(rows, cols),
        np.ascontiguousarray(scales.reshape(rows, per_row)),
        None if mins is None else np.ascontiguousarray(mins.reshape(rows, per_row)),
    )


def _exact_parts(name: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q [n, elements], scales, mins [n, elements / 32]) of an exact type's blocks."""
    if name == "Q8_0":
        return b[:, 2:34].view(np.int8).copy(), _f16(b, 0), None
    if name == "Q5_0":
        q = _q5_32(b, 2).view(np.int8)
        q -= 16
        return q, _f16(b, 0), None
    if name == "Q4_0":
        d = _f16(b, 0)
        return _nibbles(b[:, 2:18]), d, d * np.float32(-8)
    if name == "Q4_1":
        return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)
    if name == "Q4_K":
        d1, m1 = _k_params(b)
        return _k_nibbles(b[:, 16:144]), d1, -m1
    raise AssertionError(name)
