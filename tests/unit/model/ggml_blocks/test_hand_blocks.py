"""ggml block decoders (engine_service/model/formats/ggml_blocks.py) on hand-built blocks of every type,
each sensitive to the layout detail its mistake gets wrong (the real Gemma 3 GGUF:
tests/model/test_ggml_real_file.py)."""

from __future__ import annotations

import numpy as np
import pytest

from engine_service.model.formats.ggml_blocks import BLOCK_BY_NAME, dequantize, exact_blocks32
from tests.unit.model.ggml_blocks.cases import ALL_TYPES, HAND, _hand, _u8
from tests.unit.model.ggml_blocks.hand_kquants import _K_MN, _K_SC


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
