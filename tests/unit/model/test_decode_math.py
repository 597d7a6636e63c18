"""Decode-path math in fast_math (shared RoPE tables, the compiled RMSNorm) against float64 numpy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.model import fast_math
from tests.model.naive_reference import rms as naive_rms
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
        x[:, :, None, :],
        32,
        traditional=traditional,
        base=500.0,
        scale=1.0,
        offset=mx.array(pos, dtype=mx.int32),
    )[:, :, 0, :]
    assert mx.abs(got - want).max().item() < 1e-3


@pytest.mark.parametrize("rows", [1, 3, fast_math.RmsNorm.MAX_COMPILED_ROWS + 5])
def test_rms_norm_matches_reference_on_both_paths(rows):
    rng = np.random.default_rng(2)
    # small activations so that eps visibly matters (a wrong eps must fail, see the control below)
    x = (rng.standard_normal((rows, 48)) * 0.05).astype(np.float32)
    w = rng.standard_normal(48).astype(np.float32)
    got = np.array(fast_math.rms_norm(1e-3)(mx.array(x), mx.array(w)))
    assert np.abs(got - naive_rms(x.astype(np.float64), w, 1e-3)).max() < 1e-5
    assert np.abs(got - naive_rms(x.astype(np.float64), w, 1e-6)).max() > 1e-2
