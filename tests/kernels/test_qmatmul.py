"""The compiled q8_0 / q4_1 matmul kernels against numpy references built from the raw blocks.

References: float64 dots of the dequantized weights (float activations: only float32 rounding
separates them, bound 1e-5 of the sum of |terms|), and for int8 activations exact integer block dots
(same bound) plus the documented activation-quantization bound vs the float64 dot.
"""

from __future__ import annotations

import numpy as np
import pytest

import engine_service  # noqa: F401  (OpenBLAS before mlx)

mx = pytest.importorskip("mlx.core")
fk = pytest.importorskip("forkline_kernels", reason="compiled kernels not built (scripts/setup.sh)")


def q8_0_weights(rng, n: int, k: int):
    """Random q8_0 blocks: wq int8 [N, Kp], scales [N, Kp/32]; padded columns hold junk (x is 0 there)."""
    kp = -(-k // 32) * 32
    wq = rng.integers(-127, 128, size=(n, kp), dtype=np.int8)
    scales = (rng.random((n, kp // 32)) * 0.02).astype(np.float32)
    deq = (wq.reshape(n, -1, 32).astype(np.float64) * scales[..., None]).reshape(n, kp)[:, :k]
    return (mx.array(wq), mx.array(scales)), deq, wq.astype(np.int64)


def q4_1_weights(rng, n: int, k: int):
    kp = -(-k // 32) * 32
    q = rng.integers(0, 16, size=(n, kp // 32, 32), dtype=np.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8).reshape(n, kp // 2)
    scales = (rng.random((n, kp // 32)) * 0.02).astype(np.float32)
    mins = (rng.standard_normal((n, kp // 32)) * 0.1).astype(np.float32)
    deq = (q.astype(np.float64) * scales[..., None] + mins[..., None]).reshape(n, kp)[:, :k]
    return (mx.array(packed), mx.array(scales), mx.array(mins)), deq, q.reshape(n, kp).astype(np.int64)


FORMATS = {"q8_0": (q8_0_weights, fk.q8_0_matmul), "q4_1": (q4_1_weights, fk.q4_1_matmul)}
LEVELS = ["scalar", "avx2", "avx512"]
ISAS = LEVELS[: LEVELS.index(fk.best_isa()) + 1]  # the ones this CPU runs
SHAPES = [(1, 1, 32), (1, 5, 40), (3, 7, 96), (8, 130, 576), (64, 33, 100), (2, 1728, 576), (5, 9, 1536)]


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    fk.set_isa(fk.best_isa())
    fk._ext._set_f32_tile(0, 0)


def float_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """1e-5 of sum |x_k w_nk| (float32 accumulation over <= 1536 terms stays far below)."""
    return 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T) + 1e-30


@pytest.mark.parametrize("panel", [False, True], ids=["dot-product", "panel-gemm"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_float_activations_match_float64_dot_of_dequantized_weights(fmt, m, n, k, panel):
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(m * 1000 + n + k)
    arrays, deq, _ = make(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = np.array(op(mx.array(x), *arrays, panel=panel))
    ref = x.astype(np.float64) @ deq.T
    assert y.shape == (m, n) and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= float_bound(x, deq)), np.abs(y - ref).max()


def quantize_activations(x: np.ndarray):
    """The kernels' int8 activation quantization in numpy float32 (rint: round half to even)."""
    m, k = x.shape
    kp = -(-k // 32) * 32
    blocks = np.zeros((m, kp), np.float32)
    blocks[:, :k] = x
    blocks = blocks.reshape(m, -1, 32)
    amax = np.abs(blocks).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(blocks * inv[..., None]).astype(np.int64)
    return xq, (amax / np.float32(127)).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_activations_match_exact_integer_arithmetic(fmt, m, n, k):
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(7 + m + n * k)
    arrays, deq, q = make(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = np.array(op(mx.array(x), *arrays, quantize_x=True)).astype(np.float64)
    xq, xd = quantize_activations(x)
    wq = q.reshape(n, -1, 32)
    scales = np.array(arrays[1]).astype(np.float64)
    isum = np.einsum("mbi,nbi->mnb", xq, wq)  # exact int64 block dots
    terms = isum * (xd.astype(np.float64)[:, None, :] * scales[None])
    if fmt == "q4_1":
        mins = np.array(arrays[2]).astype(np.float64)
        terms = terms + mins[None] * (xd.astype(np.float64) * xq.sum(-1))[:, None, :]
    exact = terms.sum(-1)
    assert np.all(np.abs(y - exact) <= 1e-5 * np.abs(terms).sum(-1) + 1e-30)
    # vs the float64 dot: each activation moves by at most half its block's step (amax / 254)
    step = np.repeat(xd.astype(np.float64) / 2, 32, axis=1)[:, :k]
    bound = step @ np.abs(deq).T * (1 + 1e-4) + float_bound(x, deq)
    assert np.all(np.abs(y - x.astype(np.float64) @ deq.T) <= bound)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("quantize_x", [False, True])
def test_batch_invariance_row_alone_equals_row_in_batch(fmt, quantize_x):
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(3)
    arrays, _, _ = make(rng, 1728, 576)
    x = mx.array(rng.standard_normal((64, 576)).astype(np.float32))
    batch64 = np.array(op(x, *arrays, quantize_x=quantize_x))
    batch8 = np.array(op(x[:8], *arrays, quantize_x=quantize_x))
    for i in (0, 3, 7):
        alone = np.array(op(x[i : i + 1], *arrays, quantize_x=quantize_x))[0]
        assert np.array_equal(alone, batch8[i]) and np.array_equal(alone, batch64[i])
    assert np.array_equal(batch8, batch64[:8])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("quantize_x", [False, True])
def test_scalar_fallback_and_thread_count_give_identical_bits(fmt, quantize_x):
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(4)
    arrays, _, _ = make(rng, 203, 200)
    x = mx.array(rng.standard_normal((9, 200)).astype(np.float32))
    fast = np.array(op(x, *arrays, quantize_x=quantize_x))
    for isa in ISAS:
        assert fk.set_isa(isa) == isa
        assert np.array(op(x, *arrays, quantize_x=quantize_x)).tobytes() == fast.tobytes(), isa
    fk.set_isa(fk.best_isa())
    threads = fk.num_threads()
    try:
        fk.set_num_threads(1)
        single = np.array(op(x, *arrays, quantize_x=quantize_x))
    finally:
        fk.set_num_threads(threads)
    assert np.array_equal(fast, single)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_tile_shape_and_isa_gives_identical_bits(fmt):
    """The float kernels' register tiles (1..8 activation rows x 1..4 weight rows, on 16 and on 32 vector
    registers; at one or two rows adjacent or spread weight rows) share loads between outputs but never
    change an output's operations: every shape, every row count and the scalar reference agree bit for
    bit (what batch invariance rests on)."""
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(11)
    arrays, _, _ = make(rng, 71, 200)  # 71 outputs: every weight-row tile leaves a tail
    x = mx.array(rng.standard_normal((13, 200)).astype(np.float32) * 3)
    fk.set_isa("scalar")
    want = np.array(op(x, *arrays))
    for isa in ISAS[1:]:
        fk.set_isa(isa)
        for rows in range(9):
            for cols in range(5):
                for spread in (-1, 0, 1):
                    fk._ext._set_f32_tile(rows, cols, spread=spread)
                    for m in (1, 2, 5, 8, 13):
                        got = np.array(op(x[:m], *arrays))
                        assert got.tobytes() == want[:m].tobytes(), (isa, rows, cols, spread, m)
    fk._ext._set_f32_tile(0, 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pool_policy_never_changes_a_value(fmt):
    """Any thread count and idle / wake policy (caller alone, workers spinning or asleep, tasks shared
    from the first microsecond) gives the same bits, for one row and many."""
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(9)
    arrays, _, _ = make(rng, 3072, 576)
    x = mx.array(rng.standard_normal((16, 576)).astype(np.float32))
    want = [np.array(op(x[:m], *arrays)) for m in (1, 3, 16)]
    threads, tuning = fk.num_threads(), fk.pool_tuning()
    policies = [
        dict(parallel_us=0.0, wake_us=0.0, spin_us=0.0),
        dict(parallel_us=0.0, wake_us=1e9, spin_us=1e4, yield_=False),
        dict(parallel_us=1e9),
    ]
    try:
        for n in (1, 2, 3):
            fk.set_num_threads(n)
            for policy in policies:
                fk.set_pool_tuning(**{**tuning, **policy})
                for _ in range(3):
                    got = [np.array(op(x[:m], *arrays)) for m in (1, 3, 16)]
                    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want, strict=True))
    finally:
        fk.set_pool_tuning(**tuning)
        fk.set_num_threads(threads)


def test_concurrent_streams_share_the_pool():
    """Two Python threads, each on its own MLX CPU stream, calling kernels of many sizes at once: every
    result is the one computed alone (the pool serializes jobs; tasks never leak between them)."""
    import threading

    rng = np.random.default_rng(10)
    arrays, _, _ = q8_0_weights(rng, 1000, 192)
    xs = [mx.array(rng.standard_normal((m, 192)).astype(np.float32)) for m in (1, 2, 7, 40)]
    want = [np.array(fk.q8_0_matmul(x, *arrays)) for x in xs]
    errors = []

    def worker(seed):
        stream = mx.new_stream(mx.cpu)
        order = np.random.default_rng(seed).integers(0, len(xs), 200)
        for i in order:
            got = np.array(fk.q8_0_matmul(xs[i], *arrays, stream=stream))
            if got.tobytes() != want[i].tobytes():
                errors.append(i)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_batched_and_half_inputs(fmt):
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(5)
    arrays, deq, _ = make(rng, 70, 96)
    base = rng.standard_normal((96, 6)).astype(np.float32)
    xt = mx.array(base).T  # [6, 96], column-major view
    ref = base.T.astype(np.float64) @ deq.T
    assert np.all(np.abs(np.array(op(xt, *arrays)) - ref) <= float_bound(base.T, deq))
    wide = mx.array(rng.standard_normal((4, 192)).astype(np.float32))
    strided = wide[:, ::2]
    ref = np.array(strided).astype(np.float64) @ deq.T
    assert np.all(np.abs(np.array(op(strided, *arrays)) - ref) <= float_bound(np.array(strided), deq))
    x3 = mx.array(rng.standard_normal((2, 3, 96)).astype(np.float32))
    y3 = np.array(op(x3, *arrays))
    assert y3.shape == (2, 3, 70)
    assert np.array_equal(y3.reshape(6, 70), np.array(op(x3.reshape(6, 96), *arrays)))
    half = x3.astype(mx.float16)
    assert np.array_equal(np.array(op(half, *arrays)), np.array(op(half.astype(mx.float32), *arrays)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_inside_mx_compile(fmt):
    make, op = FORMATS[fmt]
    rng = np.random.default_rng(6)
    arrays, _, _ = make(rng, 40, 64)
    x = mx.array(rng.standard_normal((3, 64)).astype(np.float32))

    def f(x):
        return mx.tanh(op(x * 2.0, *arrays)) + 1.0

    assert np.array_equal(np.array(mx.compile(f)(x)), np.array(f(x)))


def test_bad_arguments_raise_value_error():
    rng = np.random.default_rng(8)
    (wq, scales), _, _ = q8_0_weights(rng, 8, 64)
    with pytest.raises(ValueError, match="columns"):
        fk.q8_0_matmul(mx.zeros((1, 100)), wq, scales)
    with pytest.raises(ValueError, match="int8"):
        fk.q8_0_matmul(mx.zeros((1, 64)), wq.astype(mx.uint8), scales)
    with pytest.raises(ValueError, match="scales"):
        fk.q8_0_matmul(mx.zeros((1, 64)), wq, scales[:, :1])
    with pytest.raises(ValueError, match="isa"):
        fk.set_isa("avx1024")
