"""ggml block decoders (engine_service/model/formats/ggml_blocks.py): hand-built blocks, the test writer's
quantizers, the ``gguf`` package as an independent oracle, the exact 32-weight forms and bad input (the
real Gemma 3 GGUF: tests/model/test_ggml_real_file.py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from engine_service.api.errors import InvalidArgument
from engine_service.model.formats.ggml_blocks import (
    BLOCK_BY_NAME,
    BLOCK_TYPES,
    EXACT_FORMAT,
    Blocks32,
    BlockType,
    dequantize,
    exact_blocks32,
)
from engine_service.model.loading.gguf_file import GGUFFile
from tests.model.gguf_writer import QUANTIZERS, BlockQuant, write_gguf

ALL_TYPES = [b.name for b in BLOCK_TYPES.values()]
QUANTIZED = [b.name for b in BLOCK_TYPES.values() if b.elements > 1]
NOT_EXACT = sorted(set(ALL_TYPES) - set(EXACT_FORMAT))


def _f16(x: float) -> bytes:
    return struct.pack("<e", x)


def _f16v(x: float) -> float:
    """The float16 nearest x, as a Python float."""
    return struct.unpack("<e", struct.pack("<e", x))[0]


def _u8(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, np.uint8)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal float32 arrays, bit for bit (NaN patterns included)."""
    return (
        a.dtype == b.dtype == np.float32
        and a.shape == b.shape
        and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    )


# --- (a) hand-built blocks ------------------------------------------------------------------------
#
# Each builder writes a few blocks field by field (struct and plain Python, one weight at a time) and
# returns (bytes, expected weights by the formula, the weights a plausible layout mistake would give).
# The blocks are 2 rows x 2 blocks so row and block order matter too.


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


def _pack_nibbles(q):
    """32 4-bit values: byte j = q[j] | q[j + 16] << 4."""
    return bytes(q[j] | (q[j + 16] << 4) for j in range(16))


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


def _q5_fields(q):
    """32 5-bit values -> (uint32 qh with bit j = bit 4 of q[j], 16 bytes of low nibbles)."""
    qh = 0
    for j, v in enumerate(q):
        qh |= (v >> 4) << j
    return struct.pack("<I", qh), _pack_nibbles([v & 15 for v in q])


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


HAND = {
    "Q8_0": _hand_q8_0,
    "Q4_0": _hand_q4_0,
    "Q4_1": _hand_q4_1,
    "Q5_0": _hand_q5_0,
    "Q5_1": _hand_q5_1,
    "Q4_K": _hand_q4_k,
    "Q5_K": _hand_q5_k,
    "Q6_K": _hand_q6_k,
    "F16": _hand_f16,
    "BF16": _hand_bf16,
    "F32": _hand_f32,
}


def _hand(name):
    raw, want, wrong = HAND[name](np.random.default_rng(sum(map(ord, name))))
    rows = 2
    cols = len(want) // rows
    # expected in float64 (exact here), rounded once to float32 like ggml's float32 arithmetic
    return raw, rows, cols, np.asarray(want).reshape(rows, cols).astype(np.float32), np.asarray(wrong)


def test_every_type_has_a_hand_case():
    assert set(HAND) == set(ALL_TYPES)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_hand_built_blocks(name):
    raw, rows, cols, want, wrong = _hand(name)
    got = dequantize(BLOCK_BY_NAME[name], _u8(raw), rows, cols)
    assert got.dtype == np.float32 and got.shape == (rows, cols)
    np.testing.assert_array_equal(got, want)
    # the case is sensitive to the layout detail its mistake gets wrong
    assert not np.array_equal(got, wrong.reshape(rows, cols).astype(np.float32))


def test_hand_q4_k_exact_parameters():
    """Q4_K's Blocks32 parameters are the float64-exact products d * sc and -(dmin * m)."""
    raw, rows, cols, want, _ = _hand("Q4_K")
    blocks = exact_blocks32(BLOCK_BY_NAME["Q4_K"], _u8(raw), rows, cols)
    ds = [(0.5, 0.25), (0.0078125, 0.001953125), (2.0, 1.5), (0.09375, 0.015625)]
    scales = [ds[b][0] * s for b in range(4) for s in _K_SC[b % 2]]
    mins = [-(ds[b][1] * m) for b in range(4) for m in _K_MN[b % 2]]
    assert blocks.scales.astype(np.float64).ravel().tolist() == scales
    assert blocks.mins.astype(np.float64).ravel().tolist() == mins
    np.testing.assert_array_equal(blocks.values(), want)


# --- (b) the writer's quantizers ------------------------------------------------------------------

# the quantizers' error bound: |w - value| <= FRACTION * R per block, R = the block's max |w| for the
# symmetric types, its range max(w) - min(0 or min(w)) for the affine ones (plus float16 rounding of
# the block minimum); BF16: relative 2**-8 per weight
BOUNDS = {
    "Q8_0": ("sym", 0.51 / 127),
    "Q4_0": ("sym", 1.01 / 8),  # d = extreme / -8: the opposite extreme clips to 7
    "Q5_0": ("sym", 1.01 / 16),
    "Q4_1": ("range", 0.51 / 15),
    "Q5_1": ("range", 0.51 / 31),
    "Q4_K": ("range0", 0.53 / 15),
    "Q5_K": ("range0", 0.53 / 31),
    "Q6_K": ("sym", 0.51 / 31),
}


def _weights(rows: int = 6, cols: int = 1024, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    w[0, ::97] *= 20  # outliers
    w[1] = np.abs(w[1]) + 0.01  # all positive
    w[2] = -np.abs(w[2]) - 0.2  # all negative
    w[3, :300] = 0.0  # zero blocks
    w[4, 256:512] = 0.125  # a constant super-block
    return w


def _bound(name: str, w: np.ndarray) -> np.ndarray:
    """The allowed |error| per weight."""
    if name == "BF16":
        return np.abs(w) * 2.0**-8
    kind, fraction = BOUNDS[name]
    block = BLOCK_BY_NAME[name].elements
    b = w.astype(np.float64).reshape(-1, block)
    amax = np.abs(b).max(axis=1, keepdims=True)
    if kind == "sym":
        r = amax
    elif kind == "range":
        r = b.max(axis=1, keepdims=True) - b.min(axis=1, keepdims=True)
    else:
        r = b.max(axis=1, keepdims=True) - np.minimum(b.min(axis=1, keepdims=True), 0)
    return np.broadcast_to(fraction * r + amax * 2.0**-10 + 1e-12, b.shape).reshape(w.shape)


def _decode(bq: BlockQuant, raw: bytes | None = None) -> np.ndarray:
    rows, cols = bq.shape
    block = next(b for b in BLOCK_TYPES.values() if b.type_id == bq.ggml_type)
    return dequantize(block, _u8(bq.blocks if raw is None else raw), rows, cols)


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_writer_quantizers_round_trip(name):
    w = _weights()
    bq = QUANTIZERS[name](w)
    assert bq.ggml_type == BLOCK_BY_NAME[name].type_id and bq.shape == w.shape
    got = _decode(bq)
    assert _same(got, bq.dequantized.astype(np.float32))
    err = np.abs(got.astype(np.float64) - w)
    assert np.all(err <= _bound(name, w)), float((err / _bound(name, w)).max())
    assert err.max() > 0  # not a lossless pass-through


def _swap_nibbles(raw: np.ndarray, start: int, stop: int, nbytes: int) -> np.ndarray:
    b = raw.reshape(-1, nbytes).copy()
    f = b[:, start:stop]
    b[:, start:stop] = (f >> 4) | (f << 4)
    return b.ravel()


# a deliberately wrong layout per type: the same bytes read with one layout detail changed
MUTATIONS = {
    "Q8_0": lambda r: r.reshape(-1, 34)[:, np.r_[0:2, 33:1:-1]].ravel(),  # quants in reverse order
    "Q4_0": lambda r: _swap_nibbles(r, 2, 18, 18),
    "Q4_1": lambda r: _swap_nibbles(r, 4, 20, 20),
    "Q5_0": lambda r: _swap_nibbles(r, 6, 22, 22),
    "Q5_1": lambda r: r.reshape(-1, 24)[:, np.r_[0:4, 7:3:-1, 8:24]].ravel(),  # qh byte order reversed
    "Q4_K": lambda r: _swap_nibbles(r, 16, 144, 144),
    "Q5_K": lambda r: r.reshape(-1, 176)[:, np.r_[0:16, 48:176, 16:48]].ravel(),  # qs before qh
    "Q6_K": lambda r: r.reshape(-1, 210)[:, np.r_[32:128, 0:32, 128:210]].ravel(),  # ql split moved
    "BF16": lambda r: r.reshape(-1, 2)[:, ::-1].ravel(),  # big-endian
}


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_negative_control_wrong_layout_fails(name):
    """The round-trip comparison catches a layout mistake: the mutated bytes decode to values that
    neither equal the writer's nor stay within the error bound."""
    w = _weights()
    bq = QUANTIZERS[name](w)
    wrong = _decode(bq, MUTATIONS[name](_u8(bq.blocks)).tobytes())
    assert not np.array_equal(wrong, bq.dequantized)
    with np.errstate(invalid="ignore"):
        assert not np.all(np.abs(wrong.astype(np.float64) - w) <= _bound(name, w))


def test_writer_gguf_of_every_type(tmp_path):
    """write_gguf takes every quantizer's output (and float32 / float16); GGUFFile reads the records back
    and dequantize gives the writer's values."""
    w = _weights(rows=5, cols=512, seed=3)
    tensors: dict[str, np.ndarray | BlockQuant] = {name: q(w) for name, q in QUANTIZERS.items()}
    tensors["F32"], tensors["F16"] = w, w.astype(np.float16)
    path = str(tmp_path / "types.gguf")
    write_gguf(path, {"general.architecture": "test"}, tensors)
    with GGUFFile(path) as f:
        assert set(f.tensors) == set(ALL_TYPES)
        for name, t in tensors.items():
            rec = f.tensors[name]
            assert rec.type_name == name and rec.rows_cols == (5, 512)
            got = dequantize(rec.block, f.tensor_bytes(name), *rec.rows_cols)
            want = t.dequantized if isinstance(t, BlockQuant) else t.astype(np.float32)
            assert _same(got, want), name


# --- (c) the gguf package as an oracle ------------------------------------------------------------


def oracle(name: str, data: np.ndarray, rows: int) -> np.ndarray:
    gguf = pytest.importorskip("gguf")
    with np.errstate(all="ignore"):
        ref = gguf.quants.dequantize(data.reshape(rows, -1), gguf.GGMLQuantizationType[name])
    return np.asarray(ref, np.float32)


def agree(ours: np.ndarray, ref: np.ndarray) -> None:
    """Equal, NaN where the oracle has NaN, and bit-identical where finite (so -0.0 / +0.0 too)."""
    np.testing.assert_array_equal(ours, ref)
    finite = np.isfinite(ref)
    assert np.array_equal(ours.view(np.uint32)[finite], ref.view(np.uint32)[finite])


@pytest.mark.parametrize("name", ALL_TYPES)
def test_matches_gguf_package_on_random_bytes(name):
    """Random bytes (every bit pattern of every field, NaN / inf scales included) over enough blocks
    to cross the decoder's chunks."""
    block = BLOCK_BY_NAME[name]
    rows, cols = 300, 1024
    data = np.random.default_rng(block.type_id).integers(0, 256, rows * cols // block.elements * block.nbytes)
    data = data.astype(np.uint8)
    agree(dequantize(block, data, rows, cols), oracle(name, data, rows))


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_matches_gguf_package_on_writer_blocks(name):
    w = _weights()
    bq = QUANTIZERS[name](w)
    agree(_decode(bq), oracle(name, _u8(bq.blocks), w.shape[0]))


@pytest.mark.parametrize("name", QUANTIZED)
def test_matches_gguf_package_on_hand_blocks(name):
    raw, rows, cols, want, _ = _hand(name)
    agree(oracle(name, _u8(raw), rows), want)


# --- (d) exact 32-weight blocks -------------------------------------------------------------------


def _exact_cases(name):
    block = BLOCK_BY_NAME[name]
    raw, rows, cols, _, _ = _hand(name)
    yield _u8(raw), rows, cols
    if name in QUANTIZERS:
        bq = QUANTIZERS[name](_weights())
        yield _u8(bq.blocks), *bq.shape
    rows, cols = 20, 512
    rng = np.random.default_rng(block.type_id + 100)
    data = rng.integers(0, 256, rows * cols // block.elements * block.nbytes).astype(np.uint8)
    # finite float16 parameters (exponent bits not all ones) so the values compare without NaN
    b = data.reshape(-1, block.nbytes)
    for at in {"Q8_0": [0], "Q5_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2]}[name]:
        b[:, at + 1] &= 0xBB
    yield data, rows, cols


@pytest.mark.parametrize("name", sorted(EXACT_FORMAT))
def test_exact_blocks32_equals_dequantize(name):
    block = BLOCK_BY_NAME[name]
    for data, rows, cols in _exact_cases(name):
        ex = exact_blocks32(block, data, rows, cols)
        assert isinstance(ex, Blocks32)
        assert ex.q.shape == (rows, cols)
        assert ex.scales.shape == (rows, cols // 32) and ex.scales.dtype == np.float32
        if EXACT_FORMAT[name] == "q8_0":
            assert ex.mins is None and ex.q.dtype == np.int8
            assert ex.q.min() >= (-16 if name == "Q5_0" else -128)
            assert ex.q.max() <= (15 if name == "Q5_0" else 127)
        else:
            assert ex.mins is not None and ex.mins.shape == ex.scales.shape and ex.mins.dtype == np.float32
            assert ex.q.dtype == np.uint8 and ex.q.max() <= 15
        got = dequantize(block, data, rows, cols)
        np.testing.assert_array_equal(ex.values(), got)
        # the same values from the fields directly, in float64 (products of the block parameters exact)
        q = ex.q.astype(np.float64).reshape(rows, -1, 32)
        w64 = q * ex.scales[..., None].astype(np.float64)
        if ex.mins is not None:
            w64 += ex.mins[..., None]
        np.testing.assert_array_equal(w64.astype(np.float32).reshape(rows, cols), got)


def test_exact_q8_0_keeps_minus_128_and_q4_0_min():
    raw, rows, cols, _, _ = _hand("Q8_0")
    ex = exact_blocks32(BLOCK_BY_NAME["Q8_0"], _u8(raw), rows, cols)
    assert ex.q[0, 0] == -128 and ex.q[0, 1] == 127 and ex.scales[0, 0] == np.float32(-0.375)
    raw, rows, cols, _, _ = _hand("Q4_0")
    ex = exact_blocks32(BLOCK_BY_NAME["Q4_0"], _u8(raw), rows, cols)
    np.testing.assert_array_equal(ex.mins, -8 * ex.scales)
    assert ex.scales.ravel().tolist() == [0.5, -0.25, 3.0, 0.0625]


@pytest.mark.parametrize("name", NOT_EXACT)
def test_exact_blocks32_none_for_inexact_types(name):
    raw, rows, cols, _, _ = _hand(name)
    assert exact_blocks32(BLOCK_BY_NAME[name], _u8(raw), rows, cols) is None


def test_exact_format_table():
    assert EXACT_FORMAT == {"Q8_0": "q8_0", "Q5_0": "q8_0", "Q4_0": "q4_1", "Q4_1": "q4_1", "Q4_K": "q4_1"}
    assert set(EXACT_FORMAT) <= set(BLOCK_BY_NAME)


# --- (e) bad input --------------------------------------------------------------------------------


def _bad_cases():
    k4 = BLOCK_BY_NAME["Q4_K"]
    q8 = BLOCK_BY_NAME["Q8_0"]
    good = np.zeros(2 * 144, np.uint8)  # Q4_K [2, 256]
    return [
        ("short", k4, good[:-1], 2, 256, ["Q4_K", "288", "287"]),
        ("long", k4, np.zeros(289, np.uint8), 2, 256, ["Q4_K", "288", "289"]),
        ("empty", q8, np.zeros(0, np.uint8), 1, 32, ["Q8_0", "34"]),
        ("rows mismatch", k4, good, 3, 256, ["Q4_K", "[3, 256]", "432"]),
        ("cols not a multiple", k4, good, 1, 576, ["Q4_K", "576", "256"]),
        ("cols not a multiple of 32", q8, np.zeros(34, np.uint8), 1, 40, ["Q8_0", "40", "32"]),
        ("int8 data", k4, good.view(np.int8), 2, 256, ["Q4_K", "uint8", "int8"]),
        ("float32 data", k4, good.view(np.float32), 2, 256, ["Q4_K", "uint8", "float32"]),
        ("2-D data", k4, good.reshape(2, 144), 2, 256, ["Q4_K", "1-D", "(2, 144)"]),
        ("bytes", k4, bytes(288), 2, 256, ["Q4_K", "bytes"]),
        ("zero rows", q8, np.zeros(0, np.uint8), 0, 32, ["Q8_0", "rows", ">= 1"]),
        ("negative cols", q8, np.zeros(34, np.uint8), 1, -32, ["Q8_0", "cols", ">= 1"]),
        ("float rows", q8, np.zeros(34, np.uint8), 1.0, 32, ["Q8_0", "rows", "an int"]),
        ("bool rows", q8, np.zeros(34, np.uint8), True, 32, ["Q8_0", "rows", "an int"]),
        ("unknown type", BlockType(99, "Q9_9", 32, 10), np.zeros(10, np.uint8), 1, 32, ["Q9_9"]),
        ("forged layout", BlockType(8, "Q8_0", 32, 30), np.zeros(30, np.uint8), 1, 32, ["Q8_0"]),
    ]


@pytest.mark.parametrize("fn", [dequantize, exact_blocks32], ids=["dequantize", "exact_blocks32"])
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_is_invalid_argument(fn, case):
    _, block, data, rows, cols, words = case
    with pytest.raises(InvalidArgument) as info:
        fn(block, data, rows, cols)
    for word in words:
        assert word in str(info.value)


def test_good_input_next_to_the_bad_cases():
    """The valid neighbours of the bad cases decode (so the checks above reject only what is wrong)."""
    assert dequantize(BLOCK_BY_NAME["Q4_K"], np.zeros(288, np.uint8), 2, 256).shape == (2, 256)
    assert dequantize(BLOCK_BY_NAME["Q8_0"], np.zeros(34, np.uint8), np.int64(1), 32).shape == (1, 32)
    strided = np.zeros(68, np.uint8)[::2]  # a non-contiguous 1-D view
    assert dequantize(BLOCK_BY_NAME["Q8_0"], strided, 1, 32).shape == (1, 32)


def test_decode_does_not_write_its_input():
    raw, rows, cols, _, _ = _hand("Q6_K")
    data = _u8(raw)  # read-only, like a memory-mapped tensor
    assert not data.flags.writeable
    dequantize(BLOCK_BY_NAME["Q6_K"], data, rows, cols)
    exact_blocks32(BLOCK_BY_NAME["Q4_K"], _u8(_hand("Q4_K")[0]), 2, 512)
    assert bytes(data) == raw
