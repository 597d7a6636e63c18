"""The panel GEMM (``panel=True``, kernels/src/gemm.h) against numpy references built from the raw blocks.

References: float64 dots of the dequantized weights (bound 1e-5 of the sum of |terms|); row locality
(a row alone gives its bits in any block of rows), the scalar version and one thread give the same
bits. Control: on some output it differs from the dot-product kernels in the last bits (their
summation orders differ), so these checks do run the panel path.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.test_qmatmul import FORMATS, ISAS, fk, float_bound, mx

# (M, N, K): row tails of the 6-row tile, partial 16-column panels, padded K, panel groups of 1..5
SHAPES = [(1, 16, 32), (7, 40, 100), (13, 33, 576), (64, 960, 576), (130, 576, 1536), (6, 1, 32)]


def panel(op, x, arrays):
    return np.array(op(x, *arrays, panel=True))


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    fk.set_isa(fk.best_isa())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_panel_gemm_matches_float64_dot_of_dequantized_weights(fmt, m, n, k):
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(m * 1000 + n + k)
    arrays, deq, _ = make(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = panel(op, mx.array(x), arrays)
    ref = x.astype(np.float64) @ deq.T
    assert y.shape == (m, n) and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= float_bound(x, deq)), np.abs(y - ref).max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_alone_equals_the_same_row_in_any_block(fmt):
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(5)
    arrays, _, _ = make(rng, 200, 576)
    x = mx.array(rng.standard_normal((29, 576)).astype(np.float32))
    block = panel(op, x, arrays)
    for m in (1, 2, 5, 6, 7, 12, 13):
        assert panel(op, x[:m], arrays).tobytes() == block[:m].tobytes(), m
    for i in (0, 5, 6, 28):
        assert panel(op, x[i : i + 1], arrays)[0].tobytes() == block[i].tobytes(), i


@pytest.mark.parametrize("fmt", FORMATS)
def test_scalar_version_and_one_thread_give_identical_bits(fmt):
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(6)
    arrays, _, _ = make(rng, 83, 1536)  # 83: a partial last panel
    x = mx.array(rng.standard_normal((11, 1536)).astype(np.float32))
    fast = panel(op, x, arrays)
    for isa in ISAS:
        fk.set_isa(isa)
        assert panel(op, x, arrays).tobytes() == fast.tobytes(), isa
    fk.set_isa(fk.best_isa())
    threads = fk.num_threads()
    try:
        fk.set_num_threads(1)
        single = panel(op, x, arrays)
    finally:
        fk.set_num_threads(threads)
    assert single.tobytes() == fast.tobytes()


@pytest.mark.parametrize("fmt", FORMATS)
def test_control_the_panel_path_is_not_the_dot_product_kernels(fmt):
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(7)
    arrays, _, _ = make(rng, 256, 576)
    x = mx.array(rng.standard_normal((64, 576)).astype(np.float32))
    tiles = np.array(op(x, *arrays))
    got = panel(op, x, arrays)
    assert np.allclose(got, tiles, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(got, tiles), "the panel flag did not change the summation order"
