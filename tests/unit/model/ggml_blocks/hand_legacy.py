"""Hand-built ggml blocks of the 32-weight types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and the float types.

Each builder writes a few blocks field by field (struct and plain Python, one weight at a time) and
returns (bytes, expected weights by the formula, the weights a plausible layout mistake would give).
The blocks are 2 rows x 2 blocks so row and block order matter too.
"""

from __future__ import annotations

import struct

import numpy as np


def _f16(x: float) -> bytes:
    return struct.pack("<e", x)


def _f16v(x: float) -> float:
    """The float16 nearest x, as a Python float."""
    return struct.unpack("<e", struct.pack("<e", x))[0]


def _pack_nibbles(q):
    """32 4-bit values: byte j = q[j] | q[j + 16] << 4."""
    return bytes(q[j] | (q[j + 16] << 4) for j in range(16))


def _q5_fields(q):
    """32 5-bit values -> (uint32 qh with bit j = bit 4 of q[j], 16 bytes of low nibbles)."""
    qh = 0
    for j, v in enumerate(q):
        qh |= (v >> 4) << j
    return struct.pack("<I", qh), _pack_nibbles([v & 15 for v in q])


def _hand_q8_0(rng):
    raw, want, wrong = b"", [], []
    for blk in range(4):
        d = [-0.375, 0.0078125, 1.5, -2.0][blk]
        q = [int(v) for v in rng.integers(-128, 128, 32)]
        q[0], q[1] = -128, 127  # the int8 extremes
        raw += _f16(d) + struct.pack("<32b", *q)
        want += [d * v for v in q]
        wrong += [d * (v & 0xFF) for v in q]  # mistake: q read as unsigned
    return raw, want, wrong


def _hand_q4_0(rng):
    raw, want, wrong = b"", [], []
    for blk in range(4):
        d = [0.5, -0.25, 3.0, 0.0625][blk]
        q = [int(v) for v in rng.integers(0, 16, 32)]
        q[0], q[17] = 0, 15
        raw += _f16(d) + _pack_nibbles(q)
        want += [(v - 8) * d for v in q]
        swapped = q[16:] + q[:16]  # mistake: high nibble first
        wrong += [(v - 8) * d for v in swapped]
    return raw, want, wrong


def _hand_q4_1(rng):
    raw, want, wrong = b"", [], []
    for blk in range(4):
        d, m = [(0.25, -1.5), (0.125, 0.75), (1.0, -8.0), (0.03125, 0.0)][blk]
        q = [int(v) for v in rng.integers(0, 16, 32)]
        raw += _f16(d) + _f16(m) + _pack_nibbles(q)
        want += [v * d + m for v in q]
        wrong += [v * d - m for v in q]  # mistake: the min subtracted
    return raw, want, wrong


def _hand_q5_0(rng):
    raw, want, wrong = b"", [], []
    for blk in range(4):
        d = [0.125, -0.5, 2.0, 0.001953125][blk]
        q = [int(v) for v in rng.integers(0, 32, 32)]
        q[3], q[20], q[31] = 0, 31, 16  # -16, 15 and 0 after the offset
        qh, qs = _q5_fields(q)
        raw += _f16(d) + qh + qs
        want += [(v - 16) * d for v in q]
        reversed_bits = [(q[j] & 15) | ((q[31 - j] >> 4) << 4) for j in range(32)]  # mistake: qh bit 31 - j
        wrong += [(v - 16) * d for v in reversed_bits]
    return raw, want, wrong


def _hand_q5_1(rng):
    raw, want, wrong = b"", [], []
    for blk in range(4):
        d, m = [(0.0625, -1.0), (0.5, 2.5), (0.25, -0.125), (1.0, 0.0)][blk]
        q = [int(v) for v in rng.integers(0, 32, 32)]
        qh, qs = _q5_fields(q)
        raw += _f16(d) + _f16(m) + qh + qs
        want += [v * d + m for v in q]
        wrong += [((v & 15) + 32 * (v >> 4)) * d + m for v in q]  # mistake: fifth bit worth 32
    return raw, want, wrong


def _hand_f16(rng):
    vals = [0.0, -0.0, 1.0, -2.5, 65504.0, 6.1e-05, 5.96e-08, 0.333]
    raw = b"".join(_f16(v) for v in vals)
    return raw, [_f16v(v) for v in vals], [_f16v(v) * 2 for v in vals]


def _hand_bf16(rng):
    vals = [1.0, -3.5, 0.15625, 1e30, -1e-30, 0.0, 255.0, 7.0]
    raw, want = b"", []
    for v in vals:
        top = struct.unpack("<I", struct.pack("<f", v))[0] >> 16  # truncation: these are exact or near
        raw += struct.pack("<H", top)
        want.append(struct.unpack("<f", struct.pack("<I", top << 16))[0])
    wrong = [
        struct.unpack("<f", struct.pack("<I", struct.unpack("<H", raw[2 * i : 2 * i + 2])[0]))[0]
        for i in range(8)
    ]
    return raw, want, wrong


def _hand_f32(rng):
    vals = [float(v) for v in rng.standard_normal(8).astype(np.float32)]
    return struct.pack("<8f", *vals), vals, vals[::-1]
