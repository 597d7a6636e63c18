"""Hand-built ggml K-quant super-blocks (Q4_K, Q5_K, Q6_K of 256 weights), built like hand_legacy's."""

from __future__ import annotations

import struct

from tests.unit.model.ggml_blocks.hand_legacy import _f16


def _k_scale_bytes(sc, mn):
    """The 12 bytes of get_scale_min_k4's packing, byte by byte."""
    out = [0] * 12
    for j in range(4):
        out[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
        out[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6)
        out[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4)
    return bytes(out)


def _k_quant_bytes(q4):
    """256 4-bit values: byte 32c + j = q[64c + j] | q[64c + 32 + j] << 4."""
    return bytes(q4[64 * c + j] | (q4[64 * c + 32 + j] << 4) for c in range(4) for j in range(32))


# sub-block scales / mins with values >= 16 in sub-blocks 4-7 (their top 2 bits live in bytes 0-7) and
# values using all 6 bits in sub-blocks 0-3
_K_SC = [[1, 63, 17, 40, 5, 33, 48, 62], [63, 0, 31, 32, 16, 63, 1, 47]]

_K_MN = [[0, 7, 63, 20, 35, 2, 50, 19], [12, 63, 1, 45, 63, 30, 17, 0]]


def _k_expected(d, dmin, sc, mn, q, mistake: bool):
    if mistake:  # sub-blocks 4-7 without their top 2 bits
        sc = sc[:4] + [s & 15 for s in sc[4:]]
        mn = mn[:4] + [m & 15 for m in mn[4:]]
    return [(d * sc[i // 32]) * q[i] - dmin * mn[i // 32] for i in range(256)]


def _hand_q4_k(rng):
    raw, want, wrong = b"", [], []
    for blk in range(4):
        d, dmin = [(0.5, 0.25), (0.0078125, 0.001953125), (2.0, 1.5), (0.09375, 0.015625)][blk]
        sc, mn = _K_SC[blk % 2], _K_MN[blk % 2]
        q = [int(v) for v in rng.integers(0, 16, 256)]
        raw += _f16(d) + _f16(dmin) + _k_scale_bytes(sc, mn) + _k_quant_bytes(q)
        want += _k_expected(d, dmin, sc, mn, q, False)
        wrong += _k_expected(d, dmin, sc, mn, q, True)
    return raw, want, wrong


def _hand_q5_k(rng):
    raw, want, wrong = b"", [], []
    for blk in range(4):
        d, dmin = [(0.25, 0.125), (0.015625, 0.5), (1.0, 0.0), (0.046875, 0.0078125)][blk]
        sc, mn = _K_SC[(blk + 1) % 2], _K_MN[blk % 2]
        q = [int(v) for v in rng.integers(0, 32, 256)]
        qh = [0] * 32
        for c in range(4):
            for j in range(32):
                qh[j] |= (q[64 * c + j] >> 4) << (2 * c)
                qh[j] |= (q[64 * c + 32 + j] >> 4) << (2 * c + 1)
        raw += _f16(d) + _f16(dmin) + _k_scale_bytes(sc, mn) + bytes(qh) + _k_quant_bytes([v & 15 for v in q])
        want += _k_expected(d, dmin, sc, mn, q, False)
        # mistake: the fifth bits of the second 32 of each chunk read from bit 2c instead of 2c + 1
        bad = list(q)
        for c in range(4):
            for j in range(32):
                bad[64 * c + 32 + j] = (q[64 * c + 32 + j] & 15) | (((qh[j] >> (2 * c)) & 1) << 4)
        wrong += _k_expected(d, dmin, sc, mn, bad, False)
    return raw, want, wrong


def _hand_q6_k(rng):
    raw, want, wrong = b"", [], []
    for blk in range(4):
        d = [0.0625, -0.5, 0.00390625, 1.0][blk]
        sc = [int(v) for v in rng.integers(-128, 128, 16)]
        sc[0], sc[15] = -128, 127
        q = [int(v) for v in rng.integers(0, 64, 256)]  # stored, value q - 32
        q[0], q[255] = 0, 63
        ql, qh = [0] * 128, [0] * 64
        for h in range(2):
            for j in range(32):
                w0, w1, w2, w3 = (q[128 * h + 32 * k + j] for k in range(4))
                ql[64 * h + j] = (w0 & 15) | ((w2 & 15) << 4)
                ql[64 * h + 32 + j] = (w1 & 15) | ((w3 & 15) << 4)
                qh[32 * h + j] = (w0 >> 4) | ((w1 >> 4) << 2) | ((w2 >> 4) << 4) | ((w3 >> 4) << 6)
        raw += bytes(ql) + bytes(qh) + struct.pack("<16b", *sc) + _f16(d)
        want += [d * sc[i // 16] * (q[i] - 32) for i in range(256)]
        # mistake: weights 32k + l taken from nibble k // 2 ... as if ql were split low/high by halves
        bad = []
        for h in range(2):
            for k in range(4):
                for j in range(32):
                    byte = ql[64 * h + 32 * (k // 2) + j]
                    low = (byte >> (4 * (k % 2))) & 15
                    bad.append(low | (((qh[32 * h + j] >> (2 * k)) & 3) << 4))
        wrong += [d * sc[i // 16] * (bad[i] - 32) for i in range(256)]
    return raw, want, wrong
