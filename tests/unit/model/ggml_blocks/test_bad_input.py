"""Bad input to the block decoders: InvalidArgument naming the type and what is wrong; the valid
neighbours decode; the input is never written."""

from __future__ import annotations

import numpy as np
import pytest

from engine_service.api.errors import InvalidArgument
from engine_service.model.formats.ggml_blocks import BLOCK_BY_NAME, BlockType, dequantize, exact_blocks32
from tests.unit.model.ggml_blocks.cases import _hand, _u8


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
