"""A minimal GGUF v3 writer for tests (F32/F16/BF16 and Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K
tensors, scalar/string/array metadata).

Independent of the loader: it follows the published layout (header, metadata, tensor infos with ggml
dimension order innermost first, 32-byte aligned data). The quantizers are simple numpy encoders of
the published block layouts (not ggml's search for the best scales: they pick scales that cover each
block's range, so the error is at most half a step), and each computes the values its blocks stand
for with its own formula in float64 (rounded once to float32, which equals ggml's float32 arithmetic
because every product of the block parameters is exact).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_U32, _I32, _F32, _BOOL, _STR, _ARR = 4, 5, 6, 7, 8, 9


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(v) -> bytes:
    if isinstance(v, bool):
        return struct.pack("<I?", _BOOL, v)
    if isinstance(v, int):
        return struct.pack("<II", _U32, v)
    if isinstance(v, float):
        return struct.pack("<If", _F32, v)
    if isinstance(v, str):
        return struct.pack("<I", _STR) + _string(v)
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            return struct.pack("<IIQ", _ARR, _STR, len(v)) + b"".join(_string(x) for x in v)
        if v and all(isinstance(x, float) for x in v):
            return struct.pack("<IIQ", _ARR, _F32, len(v)) + struct.pack(f"<{len(v)}f", *v)
        return struct.pack("<IIQ", _ARR, _I32, len(v)) + struct.pack(f"<{len(v)}i", *v)
    raise TypeError(type(v))


@dataclass(frozen=True)
class BlockQuant:
    """A ggml block-quantized matrix: raw blocks plus the values they decode to (numpy, float32)."""

    ggml_type: int
    shape: tuple[int, ...]
    blocks: bytes
    dequantized: np.ndarray


def quantize_q8_0(w: np.ndarray) -> BlockQuant:
    """Blocks of 32: float16 scale d = amax / 127, then 32 int8 q; value = q * d."""
    b = w.astype(np.float32).reshape(-1, 32)
    d = (np.abs(b).max(axis=1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    q = np.where(df > 0, np.round(b / np.where(df > 0, df, 1)), 0).clip(-127, 127).astype(np.int8)
    blocks = b"".join(d[i].tobytes() + q[i].tobytes() for i in range(len(b)))
    return BlockQuant(8, w.shape, blocks, (q * df).reshape(w.shape).astype(np.float32))


def quantize_q4_0(w: np.ndarray) -> BlockQuant:
    """Blocks of 32: float16 scale d = (signed value of largest magnitude) / -8, then 16 bytes where
    byte j holds q[j] in the low nibble and q[j + 16] in the high one; value = (q - 8) * d."""
    b = w.astype(np.float32).reshape(-1, 32)
    idx = np.abs(b).argmax(axis=1)
    d = (b[np.arange(len(b)), idx] / -8.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    q = np.where(df != 0, np.round(b / np.where(df != 0, df, 1) + 8), 8).clip(0, 15).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    blocks = b"".join(d[i].tobytes() + packed[i].tobytes() for i in range(len(b)))
    return BlockQuant(2, w.shape, blocks, ((q.astype(np.float32) - 8) * df).reshape(w.shape))


# --- helpers for the quantizers below -------------------------------------------------------------------


def _f16_up(x: np.ndarray) -> np.ndarray:
    """The smallest float16 >= x (float16 array of x's shape)."""
    x = np.asarray(x, np.float64)
    h = x.astype(np.float16)
    return np.where(h.astype(np.float64) < x, np.nextafter(h, np.float16(np.inf)), h).astype(np.float16)


def _f16_down(x: np.ndarray) -> np.ndarray:
    """The largest float16 <= x."""
    return -_f16_up(-np.asarray(x, np.float64))


def _le_bytes(a: np.ndarray, dtype: str) -> np.ndarray:
    """[n, k] values as [n, k * itemsize] little-endian bytes."""
    a = np.ascontiguousarray(np.asarray(a).astype(dtype))
    return a.view(np.uint8).reshape(a.shape[0], -1)


def _safe_div(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    return np.where(d != 0, x / np.where(d != 0, d, 1), 0.0)


def _low_high_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 2k] 4-bit values -> [n, k] bytes: byte i = q[i] | q[i + k] << 4."""
    k = q.shape[1] // 2
    return (q[:, :k] | (q[:, k:] << 4)).astype(np.uint8)


def _bits_of(q: np.ndarray, bit: int) -> np.ndarray:
    return (q >> bit) & 1


def _bq(ggml_type: int, w: np.ndarray, fields: list[np.ndarray], values: np.ndarray) -> BlockQuant:
    blocks = np.concatenate([f.astype(np.uint8) for f in fields], axis=1)
    return BlockQuant(ggml_type, w.shape, blocks.tobytes(), values.astype(np.float32).reshape(w.shape))


def _affine_32(w: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of 32 as q * d + m, m = the block minimum rounded down to float16, d covering the range."""
    b = w.astype(np.float64).reshape(-1, 32)
    m = _f16_down(b.min(axis=1, keepdims=True))
    d = _f16_up((b.max(axis=1, keepdims=True) - m.astype(np.float64)) / levels)
    df, mf = d.astype(np.float64), m.astype(np.float64)
    q = np.clip(np.rint(_safe_div(b - mf, df)), 0, levels).astype(np.uint8)
    return q, d, m, q * df + mf


def quantize_q4_1(w: np.ndarray) -> BlockQuant:
    """Blocks of 32: float16 d, float16 m, 16 bytes of nibbles as Q4_0; value = q * d + m."""
    q, d, m, values = _affine_32(w, 15)
    return _bq(3, w, [_le_bytes(d, "<f2"), _le_bytes(m, "<f2"), _low_high_nibbles(q)], values)


def _qh_word(q5: np.ndarray) -> np.ndarray:
    """The fifth bits of 32 weights as a little-endian uint32 (bit j = weight j), [n, 4] bytes."""
    word = (_bits_of(q5, 4).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1, keepdims=True)
    return _le_bytes(word, "<u4")


def quantize_q5_0(w: np.ndarray) -> BlockQuant:
    """Blocks of 32: float16 d = (value of largest magnitude) / -16, uint32 qh of fifth bits, 16 bytes
    of low nibbles as Q4_0; stored q in [0, 31], value = (q - 16) * d (so -16 occurs)."""
    b = w.astype(np.float64).reshape(-1, 32)
    ext = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)
    d = (ext / -16).astype(np.float16)
    df = d.astype(np.float64)
    q = (np.clip(np.rint(_safe_div(b, df)), -16, 15) + 16).astype(np.uint8)
    values = (q.astype(np.float64) - 16) * df
    return _bq(6, w, [_le_bytes(d, "<f2"), _qh_word(q), _low_high_nibbles(q & 15)], values)


def quantize_q5_1(w: np.ndarray) -> BlockQuant:
    """Blocks of 32: float16 d, float16 m, uint32 qh, 16 bytes of low nibbles; value = q * d + m."""
    q, d, m, values = _affine_32(w, 31)
    return _bq(
        7, w, [_le_bytes(d, "<f2"), _le_bytes(m, "<f2"), _qh_word(q), _low_high_nibbles(q & 15)], values
    )


def _k_affine(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Super-blocks of 256 = 8 sub-blocks of 32, value = d * sc[j] * q - dmin * mn[j] with 6-bit sc, mn.
    The lowest value -dmin * mn[j] is at or below min(0, sub-block minimum) and the step d * sc[j]
    covers the rest of the range, so nothing clips.
    Returns (q [n, 256], d, dmin [n, 1], sc, mn [n, 8], values)."""
    b = w.astype(np.float64).reshape(-1, 8, 32)
    need_min = -np.minimum(b.min(axis=2), 0.0)  # [n, 8] >= 0
    dmin = _f16_up(need_min.max(axis=1, keepdims=True) / 63)
    mn = np.clip(np.ceil(_safe_div(need_min, dmin.astype(np.float64))), 0, 63)
    low = dmin.astype(np.float64) * mn  # >= need_min
    span = b.max(axis=2) + low  # the range above the lowest value
    d = _f16_up(span.max(axis=1, keepdims=True) / (levels * 63))
    sc = np.clip(np.ceil(_safe_div(span / levels, d.astype(np.float64))), 0, 63)
    step = d.astype(np.float64) * sc
    q = np.clip(np.rint(_safe_div(b + low[:, :, None], step[:, :, None])), 0, levels).astype(np.uint8)
    values = step[:, :, None] * q - low[:, :, None]  # from the stored integers (no -0.0 from rint)
    return q.reshape(-1, 256), d, dmin, sc.astype(np.uint8), mn.astype(np.uint8), values


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit (sc, mn) pairs in 12 bytes: bytes 0-3 = sc[0..3] | (top 2 bits of sc[4..7]) << 6,
    bytes 4-7 = mn[0..3] | (top 2 bits of mn[4..7]) << 6, bytes 8-11 = low 4 bits of sc[4..7] | those of
    mn[4..7] << 4."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    for j in range(4):
        out[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = mn[:, j] | ((mn[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 15) | ((mn[:, j + 4] & 15) << 4)
    return out


def _k_quant_bytes(q4: np.ndarray) -> np.ndarray:
    """256 4-bit values in 128 bytes: chunk c (64 weights) in bytes 32c..32c+31, byte 32c + l holding
    weight 64c + l in its low nibble and 64c + 32 + l in its high one."""
    chunks = [_low_high_nibbles(q4[:, 64 * c : 64 * c + 64]) for c in range(4)]
    return np.concatenate(chunks, axis=1)


def quantize_q4_k(w: np.ndarray) -> BlockQuant:
    """Q4_K: float16 d, float16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles."""
    q, d, dmin, sc, mn, values = _k_affine(w, 15)
    fields = [_le_bytes(d, "<f2"), _le_bytes(dmin, "<f2"), _k_scale_bytes(sc, mn), _k_quant_bytes(q)]
    return _bq(12, w, fields, values)


def quantize_q5_k(w: np.ndarray) -> BlockQuant:
    """Q5_K: as Q4_K with 32 bytes qh before the nibbles: bit 2c of qh[l] is the fifth bit of weight
    64c + l, bit 2c + 1 that of weight 64c + 32 + l."""
    q, d, dmin, sc, mn, values = _k_affine(w, 31)
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for c in range(4):
        qh |= _bits_of(q[:, 64 * c : 64 * c + 32], 4) << (2 * c)
        qh |= _bits_of(q[:, 64 * c + 32 : 64 * c + 64], 4) << (2 * c + 1)
    fields = [_le_bytes(d, "<f2"), _le_bytes(dmin, "<f2"), _k_scale_bytes(sc, mn), qh, _k_quant_bytes(q & 15)]
    return _bq(13, w, fields, values)


def quantize_q6_k(w: np.ndarray) -> BlockQuant:
    """Q6_K: 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 weights), float16 d; value =
    d * scale[i // 16] * (q - 32) with stored q in [0, 63]. Half h (weights 128h..128h+127) uses
    ql[64h:64h+64], qh[32h:32h+32]: for l < 32, weight 128h + 32k + l keeps its low 4 bits in the low
    (k = 0, 1) or high (k = 2, 3) nibble of ql[64h + l + 32 (k % 2)] and its top 2 bits at bit 2k of
    qh[32h + l]."""
    b = w.astype(np.float64).reshape(-1, 16, 16)
    amax = np.abs(b).max(axis=2)  # [n, 16]
    d = _f16_up(amax.max(axis=1, keepdims=True) / (31 * 127))
    sc = np.clip(np.ceil(_safe_div(amax / 31, d.astype(np.float64))), 0, 127)
    step = (d.astype(np.float64) * sc)[:, :, None]
    qs = np.clip(np.rint(_safe_div(b, step)), -32, 31).astype(np.int8)
    values = step * qs  # from the stored integers (no -0.0 from rint)
    q = (qs + 32).astype(np.uint8).reshape(-1, 256)
    n = q.shape[0]
    ql = np.zeros((n, 128), np.uint8)
    qh = np.zeros((n, 64), np.uint8)
    for h in range(2):
        for k in range(4):
            part = q[:, 128 * h + 32 * k : 128 * h + 32 * k + 32]
            at = 64 * h + 32 * (k % 2)
            ql[:, at : at + 32] |= (part & 15) << (4 * (k // 2))
            qh[:, 32 * h : 32 * h + 32] |= (part >> 4) << (2 * k)
    fields = [ql, qh, _le_bytes(sc, "<i1"), _le_bytes(d, "<f2")]
    return _bq(14, w, fields, values)


def quantize_bf16(w: np.ndarray) -> BlockQuant:
    """bfloat16 (ggml type 30): the top 16 bits of each float32, rounded to nearest even."""
    bits = np.ascontiguousarray(w, np.float32).view(np.uint32).astype(np.uint64)
    top = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    values = (top.astype(np.uint32) << 16).view(np.float32)
    return BlockQuant(30, w.shape, top.astype("<u2").tobytes(), values.reshape(w.shape))


QUANTIZERS = {
    "Q8_0": quantize_q8_0,
    "Q4_0": quantize_q4_0,
    "Q4_1": quantize_q4_1,
    "Q5_0": quantize_q5_0,
    "Q5_1": quantize_q5_1,
    "Q4_K": quantize_q4_k,
    "Q5_K": quantize_q5_k,
    "Q6_K": quantize_q6_k,
    "BF16": quantize_bf16,
}
"""ggml type name -> quantizer (float weights [rows, cols], cols a multiple of the block -> BlockQuant)."""


def write_gguf(path: str, metadata: dict, tensors: dict[str, np.ndarray | BlockQuant]) -> None:
    """tensors: name -> float32 / float16 / bfloat16 numpy array or BlockQuant (any quantizer above),
    row-major [out, in]. A bfloat16 array is one whose dtype is named ``bfloat16`` (ml_dtypes); without
    that package use :func:`quantize_bf16`."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _string(key) + _value(value)
    blobs, offset = [], 0
    for name, arr in tensors.items():
        if isinstance(arr, BlockQuant):
            ttype, shape, blob = arr.ggml_type, arr.shape, arr.blocks
        elif arr.dtype.name == "bfloat16":
            ttype, shape, blob = (
                30,
                arr.shape,
                np.ascontiguousarray(arr).view(np.uint16).astype("<u2").tobytes(),
            )
        else:
            ttype = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}[arr.dtype]
            shape, blob = arr.shape, np.ascontiguousarray(arr).tobytes()
        out += (
            _string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *reversed(shape))
        )
        out += struct.pack("<IQ", ttype, offset)
        blob += b"\0" * (-len(blob) % 32)
        blobs.append(blob)
        offset += len(blob)
    out += b"\0" * (-len(out) % 32)
    with open(path, "wb") as f:
        f.write(bytes(out))
        for blob in blobs:
            f.write(blob)


def permute_for_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion of Hugging Face Q/K rows: within each head, interleave the two rotary
    halves (row i and row i + D/2 become neighbours)."""
    out, d_in = w.shape
    d = out // heads
    return w.reshape(heads, 2, d // 2, d_in).transpose(0, 2, 1, 3).reshape(out, d_in)


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """128 byte-level tokens: 3 specials, printable ASCII, then "Ġx" pieces with their merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
    pieces = ["Ġ" + chr(c) for c in range(97, 97 + 128 - len(specials) - len(chars))]
    tokens = specials + chars + pieces
    merges = [f"Ġ {p[1]}" for p in pieces]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, merges, types
