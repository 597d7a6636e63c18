"""The shared cases of the ggml block tests: the type lists, every type's hand-built blocks (``_hand``),
the writer's test weights and bit-exact comparison."""

from __future__ import annotations

import numpy as np

from engine_service.model.formats.ggml_blocks import BLOCK_TYPES, EXACT_FORMAT, dequantize
from tests.model.gguf_writer import BlockQuant
from tests.unit.model.ggml_blocks.hand_kquants import _hand_q4_k, _hand_q5_k, _hand_q6_k
from tests.unit.model.ggml_blocks.hand_legacy import (
    _hand_bf16,
    _hand_f16,
    _hand_f32,
    _hand_q4_0,
    _hand_q4_1,
    _hand_q5_0,
    _hand_q5_1,
    _hand_q8_0,
)

ALL_TYPES = [b.name for b in BLOCK_TYPES.values()]

QUANTIZED = [b.name for b in BLOCK_TYPES.values() if b.elements > 1]

NOT_EXACT = sorted(set(ALL_TYPES) - set(EXACT_FORMAT))


def _u8(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, np.uint8)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal float32 arrays, bit for bit (NaN patterns included)."""
    return (
        a.dtype == b.dtype == np.float32
        and a.shape == b.shape
        and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    )


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


def _weights(rows: int = 6, cols: int = 1024, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    w[0, ::97] *= 20  # outliers
    w[1] = np.abs(w[1]) + 0.01  # all positive
    w[2] = -np.abs(w[2]) - 0.2  # all negative
    w[3, :300] = 0.0  # zero blocks
    w[4, 256:512] = 0.125  # a constant super-block
    return w


def _decode(bq: BlockQuant, raw: bytes | None = None) -> np.ndarray:
    rows, cols = bq.shape
    block = next(b for b in BLOCK_TYPES.values() if b.type_id == bq.ggml_type)
    return dequantize(block, _u8(bq.blocks if raw is None else raw), rows, cols)
