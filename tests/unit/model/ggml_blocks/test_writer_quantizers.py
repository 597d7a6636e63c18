"""The test writer's quantizers (tests/model/gguf_writer.py): round trips within each type's error
bound, a negative control per layout, and a GGUF file of every type."""

from __future__ import annotations

import numpy as np
import pytest

from engine_service.model.formats.ggml_blocks import BLOCK_BY_NAME, dequantize
from engine_service.model.loading.gguf_file import GGUFFile
from tests.model.gguf_writer import QUANTIZERS, BlockQuant, write_gguf
from tests.unit.model.ggml_blocks.cases import ALL_TYPES, _decode, _same, _u8, _weights

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
