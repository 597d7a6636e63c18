"""The ``gguf`` package as an independent oracle for the block decoders, and the bit-exact agreement
check (also used on the real Gemma 3 GGUF: tests/model/test_ggml_real_file.py)."""

from __future__ import annotations

import numpy as np
import pytest


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
