"""The exact 32-weight forms (``exact_blocks32``): the same values as ``dequantize`` from int8 / 4-bit
fields and float32 block parameters, and None for the types without one."""

from __future__ import annotations

import numpy as np
import pytest

from engine_service.model.formats.ggml_blocks import (
    BLOCK_BY_NAME,
    EXACT_FORMAT,
    Blocks32,
    dequantize,
    exact_blocks32,
)
from tests.model.gguf_writer import QUANTIZERS
from tests.unit.model.ggml_blocks.cases import NOT_EXACT, _hand, _u8, _weights


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
