"""fast_math.rope (shared cos/sin tables) against the float64 numpy RoPE and MLX's fast.rope."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.model import fast_math
from tests.model.naive_reference import rope as naive_rope

POSITIONS = np.array([0, 1, 7, 250, 2047, 40000])


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_matches_float64_reference_at_large_positions(traditional):
    x = np.random.default_rng(0).standard_normal((len(POSITIONS), 5, 64)).astype(np.float32)
    cos, sin = fast_math.rope_tables(mx.array(POSITIONS, dtype=mx.int32), 64, 10000.0, traditional)
    got = np.array(fast_math.rope(mx.array(x), cos, sin, traditional))
    want = naive_rope(x.astype(np.float64), POSITIONS.astype(np.float64), 10000.0, traditional)
    assert np.abs(got - want).max() < 1e-5
    # negative control: the other pairing is a different rotation
    other = naive_rope(x.astype(np.float64), POSITIONS.astype(np.float64), 10000.0, not traditional)
    assert np.abs(got - other).max() > 0.1


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_agrees_with_mlx_fast_rope(traditional):
    pos = POSITIONS[:5]
    x = mx.array(np.random.default_rng(1).standard_normal((len(pos), 3, 32)).astype(np.float32))
    cos, sin = fast_math.rope_tables(mx.array(pos, dtype=mx.int32), 32, 500.0, traditional)
    got = fast_math.rope(x, cos, sin, traditional)
    want = mx.fast.rope(
        x[:, :, None, :], 32, traditional=traditional, base=500.0, scale=1.0, offset=mx.array(pos, dtype=mx.int32)
    )[:, :, 0, :]
    assert mx.abs(got - want).max().item() < 1e-3
