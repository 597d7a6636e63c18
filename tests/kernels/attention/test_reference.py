"""The batch-invariant causal attention op against a float64 numpy attention over the keys each query
may see (by absolute position); the scalar and SIMD paths bitwise equal; strided views; bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.attention.oracle import CASES, ISAS, fk, make, mx, reference, run


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,s,hq,hkv,d,window,chunk", CASES)
def test_matches_float64_attention(isa, rows, s, hq, hkv, d, window, chunk):
    fk.set_isa(isa)
    rng = np.random.default_rng(rows * 7 + s)
    q, k, v = make(rng, s, hq, hkv, d)
    q_pos = np.arange(s - rows, s)
    kp = np.arange(s)
    got = run(q[s - rows :], q_pos, [(k, v, kp)], d**-0.5, window, chunk)
    want = reference(q[s - rows :], q_pos, k, v, kp, d**-0.5, window)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(v).max())


def test_scalar_and_avx2_are_bitwise_equal():
    if fk.best_isa() == "scalar":
        pytest.skip("no AVX2 on this CPU")
    rng = np.random.default_rng(3)
    for rows, s, hq, hkv, d, window, chunk in CASES:
        q, k, v = make(rng, s, hq, hkv, d, spread=20.0)  # large scores: exponentials near underflow too
        args = (q[s - rows :], np.arange(s - rows, s), [(k, v, np.arange(s))], d**-0.5, window, chunk)
        fk.set_isa("scalar")
        want = run(*args)
        for isa in ISAS[1:]:
            fk.set_isa(isa)
            assert run(*args).tobytes() == want.tobytes(), (isa, rows, s, hq, hkv, d, window, chunk)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_alone_equals_the_same_row_among_many(isa, threads):
    """Groups of at most 8 rows (decode) fetch value rows ahead and score a few keys per call; longer
    groups (prefill) score a chunk in one call: a row's bits must not depend on which it was in."""
    fk.set_isa(isa)
    fk.set_num_threads(threads)
    rng = np.random.default_rng(21)
    s, hq, hkv, d = 203, 8, 2, 256  # a last chunk of 11 keys: sub-calls of 8 and 3, odd pairs
    q, k, v = make(rng, s, hq, hkv, d)
    parts = [(k.astype(np.float16), v.astype(np.float16), np.arange(s))]
    many = run(q[s - 12 :], np.arange(s - 12, s), parts, d**-0.5)
    for back in (1, 5, 12):
        alone = run(q[s - back : s - back + 1], [s - back], parts, d**-0.5)
        assert alone.tobytes() == many[12 - back].tobytes(), back
    # negative control: the comparison sees the arithmetic's order (another chunk size changes the bits)
    assert run(q[s - 1 :], [s - 1], parts, d**-0.5, 0, 32).tobytes() != many[-1].tobytes()


def test_row_with_no_visible_key_is_nan():
    rng = np.random.default_rng(4)
    q, k, v = make(rng, 4, 2, 1, 8)
    out = run(q[:2], [1, 3], [(k, v, np.array([-1, -1, 2, 3]))], 0.3)
    assert np.isnan(out[0]).all() and not np.isnan(out[1]).any()


def test_strided_inputs_read_correctly():
    """q and keys as non-contiguous views (a head slice, a pool slice, a transposed value block)."""
    rng = np.random.default_rng(8)
    q, k, v = make(rng, 50, 4, 2, 16)
    big_k = mx.array(np.concatenate([k, k], axis=1))[:, 50:]  # a slice of a wider pool
    v_t = mx.array(np.ascontiguousarray(v.transpose(0, 2, 1))).transpose(0, 2, 1)  # last stride != 1
    qm = mx.array(np.concatenate([q, q], axis=1))[:, :4]
    got = np.array(
        fk.causal_attention(qm, mx.arange(50), [big_k], [v_t], [mx.arange(50)], scale=0.25, chunk=8)
    )
    assert got.tobytes() == run(q, np.arange(50), [(k, v, np.arange(50))], 0.25, 0, 8).tobytes()


def test_bad_arguments_raise():
    q = mx.zeros((2, 4, 8))
    k = mx.zeros((3, 5, 8))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        fk.causal_attention(q, mx.arange(2), [k], [k], [mx.arange(5)], scale=1.0)
    k = mx.zeros((2, 5, 8))
    with pytest.raises(ValueError, match="key_pos"):
        fk.causal_attention(q, mx.arange(2), [k], [k], [mx.arange(4)], scale=1.0)
    with pytest.raises(ValueError, match="lists of one length"):
        fk.causal_attention(q, mx.arange(2), [k], [], [mx.arange(5)], scale=1.0)
