"""The panel GEMM (``panel=True``, kernels/src/gemm.h): its float64 references are test_qmatmul's (every
shape there runs both paths); here row locality (a row alone gives its bits in any block of rows), the
scalar version and one thread give the same bits. Control: on some output it differs from the dot-product kernels in the last bits (their
summation orders differ), so these checks do run the panel path.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.test_qmatmul import FORMATS, ISAS, fk, mx


def panel(op, x, arrays):
    return np.array(op(x, *arrays, panel=True))


def case(fmt: str, seed: int, n: int, k: int, m: int):
    """(op, weight arrays, x [m, k]) of random blocks."""
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    arrays, _, _ = make(rng, n, k)
    return op, arrays, mx.array(rng.standard_normal((m, k)).astype(np.float32))


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    fk.set_isa(fk.best_isa())


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_alone_equals_the_same_row_in_any_block(fmt):
    op, arrays, x = case(fmt, 5, 200, 576, 29)
    block = panel(op, x, arrays)
    for m in (1, 2, 5, 6, 7, 12, 13):
        assert panel(op, x[:m], arrays).tobytes() == block[:m].tobytes(), m
    for i in (0, 5, 6, 28):
        assert panel(op, x[i : i + 1], arrays)[0].tobytes() == block[i].tobytes(), i


@pytest.mark.parametrize("fmt", FORMATS)
def test_scalar_version_and_one_thread_give_identical_bits(fmt):
    op, arrays, x = case(fmt, 6, 83, 1536, 11)  # 83 outputs: a partial last panel
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
    op, arrays, x = case(fmt, 7, 256, 576, 64)
    tiles = np.array(op(x, *arrays))
    got = panel(op, x, arrays)
    assert np.allclose(got, tiles, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(got, tiles), "the panel flag did not change the summation order"
