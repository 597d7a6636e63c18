"""The ``gguf`` package as an independent oracle for the block decoders: random bytes, the writer's
blocks, the hand-built blocks."""

from __future__ import annotations

import numpy as np
import pytest

from engine_service.model.formats.ggml_blocks import BLOCK_BY_NAME, dequantize
from tests.model.gguf_writer import QUANTIZERS
from tests.unit.model.ggml_blocks.cases import ALL_TYPES, QUANTIZED, _decode, _hand, _u8, _weights
from tests.unit.model.ggml_blocks.oracle import agree, oracle


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
