"""The fused decoder-layer ops (kernels/src/fused.cpp): ``fused_linear`` (RMSNorm before the q8_0 / q4_1
matmul; bias, gated activation, post-norm and residual after) and ``fused_qkv`` (the q/k/v split with
QK-norm, RoPE and the K/V dtype).

Against float64 numpy references of the documented math, then bitwise: no option == the plain matmul,
a row alone == the row in any batch (1 / 8 / 64 / 100 rows), every ISA, tile shape and thread count
the same bits, float16 / bfloat16 K/V == the float32 result rounded to nearest even.
"""

from __future__ import annotations

import numpy as np
import pytest

import engine_service  # noqa: F401  (OpenBLAS before mlx)

mx = pytest.importorskip("mlx.core")
fk = pytest.importorskip("forkline_kernels", reason="compiled kernels not built (scripts/setup.sh)")
if not hasattr(fk, "fused_linear"):
    pytest.skip("forkline_kernels predates fused_linear: rebuild (scripts/setup.sh)", allow_module_level=True)

from tests.kernels.test_qmatmul import ISAS, q4_1_weights, q8_0_weights  # noqa: E402

MAKE = {"q8_0": q8_0_weights, "q4_1": q4_1_weights}
PLAIN = {"q8_0": fk.q8_0_matmul, "q4_1": fk.q4_1_matmul}
EPS = 1e-5


@pytest.fixture(autouse=True)
def _restore():
    threads = fk.num_threads()
    yield
    fk.set_isa(fk.best_isa())
    fk._ext._set_f32_tile(0, 0)
    fk.set_num_threads(threads)


def weights(fmt: str, rng, n: int, k: int):
    arrays, deq, _ = MAKE[fmt](rng, n, k)
    if fmt == "q8_0":
        arrays = (*arrays, None)
    return arrays, deq


def rms(x: np.ndarray, w: np.ndarray, eps: float = EPS) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def act(kind: str, y: np.ndarray) -> np.ndarray:
    g, u = np.split(y.astype(np.float64), 2, axis=-1)
    if kind == "silu":
        return g * u / (1 + np.exp(-g))
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u


def close(got, want, rel=2e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    scale = np.abs(want).max() + 1e-30
    assert np.abs(got - want).max() <= rel * scale, np.abs(got - want).max() / scale


@pytest.mark.parametrize("fmt", MAKE)
@pytest.mark.parametrize("m,n,k", [(1, 64, 96), (5, 70, 200), (66, 130, 576)])
def test_without_options_equals_the_plain_matmul(fmt, m, n, k):
    rng = np.random.default_rng(m + n + k)
    (wq, sc, mins), _ = weights(fmt, rng, n, k)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    plain = PLAIN[fmt](x, wq, sc) if mins is None else PLAIN[fmt](x, wq, sc, mins)
    assert np.array(fk.fused_linear(x, wq, sc, mins)).tobytes() == np.array(plain).tobytes()


@pytest.mark.parametrize("fmt", MAKE)
@pytest.mark.parametrize("kind", ["", "silu", "gelu_tanh"])
@pytest.mark.parametrize("post", [False, True])
def test_linear_options_match_float64(fmt, kind, post):
    rng = np.random.default_rng(len(kind) + post)
    m, n, k = 7, 96, 200
    (wq, sc, mins), deq = weights(fmt, rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    norm = (rng.random(k) + 0.5).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) * 0.1
    width = n // 2 if kind else n
    post_w = (rng.random(width) + 0.5).astype(np.float32)
    resid = rng.standard_normal((m, width)).astype(np.float32)
    got = fk.fused_linear(
        mx.array(x),
        wq,
        sc,
        mins,
        norm=mx.array(norm),
        eps=EPS,
        bias=mx.array(bias),
        act=kind,
        post_norm=mx.array(post_w) if post else None,
        post_eps=EPS,
        residual=mx.array(resid),
    )
    y = rms(x, norm) @ deq.T + bias
    y = act(kind, y) if kind else y
    y = rms(y, post_w) if post else y
    close(got, y + resid)


@pytest.mark.parametrize("fmt", MAKE)
def test_rows_are_independent_of_the_batch_isa_tiles_and_threads(fmt):
    """Each option's row result is bitwise the same alone, in a batch of 8, 64 or 100 rows, on every ISA
    and float tile, and on one or more threads (what deterministic mode rests on)."""
    rng = np.random.default_rng(3)
    (wq, sc, mins), _ = weights(fmt, rng, 3072, 576)
    x = mx.array(rng.standard_normal((100, 576)).astype(np.float32))
    norm = mx.array((rng.random(576) + 0.5).astype(np.float32))
    post = mx.array((rng.random(1536) + 0.5).astype(np.float32))
    resid = mx.array(rng.standard_normal((100, 1536)).astype(np.float32))

    def call(rows):
        return np.array(
            fk.fused_linear(
                x[rows],
                wq,
                sc,
                mins,
                norm=norm,
                eps=EPS,
                act="gelu_tanh",
                post_norm=post,
                residual=resid[rows],
            )
        )

    want = call(slice(0, 100))
    for rows in (slice(0, 1), slice(3, 4), slice(0, 8), slice(0, 64), slice(50, 100)):
        assert call(rows).tobytes() == want[rows].tobytes(), rows
    for isa in ISAS:
        fk.set_isa(isa)
        for tile in ((0, 0), (1, 1), (3, 2), (6, 4), (0, 0, 0, 0), (0, 3, 0, 1)):
            fk._ext._set_f32_tile(*tile)
            for rows in (slice(0, 1), slice(0, 13)):
                assert call(rows).tobytes() == want[rows].tobytes(), (isa, tile, rows)
    fk.set_isa(fk.best_isa())
    fk._ext._set_f32_tile(0, 0)
    for threads in (1, 3):
        fk.set_num_threads(threads)
        assert call(slice(0, 100)).tobytes() == want.tobytes()


def rope_ref(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, traditional: bool) -> np.ndarray:
    """x [T, H, D]; cos, sin [T, D] (sin signed): x * cos + swap(x) * sin."""
    d = x.shape[-1]
    if traditional:
        swapped = x.reshape(*x.shape[:-1], d // 2, 2)[..., ::-1].reshape(x.shape)
    else:
        swapped = np.concatenate([x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos[:, None, :] + swapped * sin[:, None, :]


def tables(t: int, d: int, traditional: bool) -> tuple[np.ndarray, np.ndarray]:
    from engine_service.model.fast_math import rope_tables

    cos, sin = rope_tables(mx.arange(3, 3 + t, dtype=mx.int32), d, 10000.0, traditional)
    return np.array(cos).reshape(t, d), np.array(sin).reshape(t, d)


@pytest.mark.parametrize("fmt", MAKE)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_matches_float64(fmt, traditional, qk_norm):
    rng = np.random.default_rng(traditional + 2 * qk_norm)
    t, hq, hkv, d, k = 5, 6, 2, 16, 96
    n = (hq + 2 * hkv) * d
    (wq, sc, mins), deq = weights(fmt, rng, n, k)
    x = rng.standard_normal((t, k)).astype(np.float32)
    norm = (rng.random(k) + 0.5).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) * 0.1
    qn, kn = ((rng.random(d) + 0.5).astype(np.float32) for _ in range(2))
    cos, sin = tables(t, d, traditional)
    q, kk, v = fk.fused_qkv(
        mx.array(x),
        wq,
        sc,
        mins,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        norm=mx.array(norm),
        eps=EPS,
        bias=mx.array(bias),
        q_norm=mx.array(qn) if qk_norm else None,
        k_norm=mx.array(kn) if qk_norm else None,
        qk_eps=EPS,
        cos=mx.array(cos),
        sin=mx.array(sin),
        traditional=traditional,
    )
    y = rms(x, norm) @ deq.T + bias
    yq = y[:, : hq * d].reshape(t, hq, d)
    yk = y[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    if qk_norm:
        yq, yk = rms(yq, qn), rms(yk, kn)
    close(q, rope_ref(yq, cos, sin, traditional))
    close(kk, rope_ref(yk, cos, sin, traditional))
    close(v, y[:, (hq + hkv) * d :].reshape(t, hkv, d))
    assert q.dtype == kk.dtype == v.dtype == mx.float32


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_kv_is_the_float32_result_rounded_to_nearest_even(dtype):
    rng = np.random.default_rng(5)
    t, hq, hkv, d, k = 9, 4, 2, 32, 64
    (wq, sc, mins), _ = weights("q8_0", rng, (hq + 2 * hkv) * d, k)
    x = mx.array(rng.standard_normal((t, k)).astype(np.float32) * 30)
    cos, sin = (mx.array(a) for a in tables(t, d, False))
    args = dict(q_heads=hq, kv_heads=hkv, head_dim=d, cos=cos, sin=sin)
    q32, k32, v32 = fk.fused_qkv(x, wq, sc, mins, **args)
    q16, k16, v16 = fk.fused_qkv(x, wq, sc, mins, kv_dtype=dtype, **args)
    assert k16.dtype == v16.dtype == dtype and q16.dtype == mx.float32
    assert np.array(q16).tobytes() == np.array(q32).tobytes()
    for half, full in ((k16, k32), (v16, v32)):
        assert mx.array_equal(half, full.astype(dtype)).item()


def test_half_rounding_edge_values():
    """float16 / bfloat16 rounding of ties, subnormals, overflow to infinity and zero as MLX's astype."""
    vals = np.array(
        [0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.9e-8, 1e-5, -6.1e-5, 1.0009765625,
         1.00048828125, 1.00146484375, 3.3895314e38, 1.00390625, 1.01171875, -2.00390625],
        dtype=np.float32,
    )  # fmt: skip
    d = 16
    k = 2 * d
    vals = np.resize(vals, k).reshape(1, k)
    # q rows zero, then the k and v rows an identity: k, v = x exactly in float32 before the rounding
    wq = np.zeros((k + d, k), np.int8)
    wq[d:, :] = np.eye(k, dtype=np.int8)
    scales = np.ones((k + d, 1), np.float32)
    x = mx.array(vals)
    for dtype in (mx.float16, mx.bfloat16):
        _, kk, v = fk.fused_qkv(
            x, mx.array(wq), mx.array(scales), q_heads=1, kv_heads=1, head_dim=d, kv_dtype=dtype
        )
        want = mx.array(vals).astype(dtype)
        got = mx.concatenate([kk.reshape(-1), v.reshape(-1)])
        assert (
            np.array(got.astype(mx.float32)).tobytes()
            == np.array(want.astype(mx.float32)).reshape(-1).tobytes()
        )


@pytest.mark.parametrize("fmt", MAKE)
def test_qkv_rows_are_independent_of_the_batch_and_isa(fmt):
    rng = np.random.default_rng(6)
    t, hq, hkv, d, k = 70, 9, 3, 64, 576
    (wq, sc, mins), _ = weights(fmt, rng, (hq + 2 * hkv) * d, k)
    x = mx.array(rng.standard_normal((t, k)).astype(np.float32))
    norm = mx.array((rng.random(k) + 0.5).astype(np.float32))
    qn, kn = (mx.array((rng.random(d) + 0.5).astype(np.float32)) for _ in range(2))
    cos, sin = (mx.array(a) for a in tables(t, d, True))

    def call(rows):
        outs = fk.fused_qkv(
            x[rows], wq, sc, mins, q_heads=hq, kv_heads=hkv, head_dim=d, norm=norm, eps=EPS, q_norm=qn,
            k_norm=kn, qk_eps=EPS, cos=cos[rows], sin=sin[rows], traditional=True, kv_dtype=mx.float16,
        )  # fmt: skip
        return [np.array(o).tobytes() for o in outs]

    def rows_of(whole, rows):
        return [np.frombuffer(b, dtype=np.uint8).reshape(t, -1)[rows].tobytes() for b in whole]

    want = call(slice(0, t))
    for rows in (slice(0, 1), slice(5, 6), slice(0, 8), slice(6, 70)):
        assert call(rows) == rows_of(want, rows), rows
    for isa in ISAS:
        fk.set_isa(isa)
        assert call(slice(0, 3)) == rows_of(want, slice(0, 3)), isa


def test_strided_3d_input_and_inside_compile():
    rng = np.random.default_rng(7)
    (wq, sc, mins), deq = weights("q4_1", rng, 40, 64)
    base = mx.array(rng.standard_normal((2, 3, 128)).astype(np.float32))
    x = base[..., ::2]  # [2, 3, 64], strided
    resid = mx.array(rng.standard_normal((2, 3, 40)).astype(np.float32))
    got = fk.fused_linear(x, wq, sc, mins, residual=resid)
    assert got.shape == (2, 3, 40)
    close(got, np.array(x).astype(np.float64) @ deq.T + np.array(resid))
    xt = mx.array(rng.standard_normal((64, 5)).astype(np.float32)).T  # column-major [5, 64]
    close(fk.fused_linear(xt, wq, sc, mins), np.array(xt).astype(np.float64) @ deq.T)

    def f(x):
        return mx.tanh(fk.fused_linear(x * 2.0, wq, sc, mins, act="silu")) + 1.0

    x2 = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    assert np.array_equal(np.array(mx.compile(f)(x2)), np.array(f(x2)))


def test_bad_arguments_raise():
    rng = np.random.default_rng(8)
    (wq, sc, _), _ = weights("q8_0", rng, 8, 64)
    x = mx.zeros((2, 64))
    with pytest.raises(ValueError, match="act"):
        fk.fused_linear(x, wq, sc, act="relu")
    with pytest.raises(ValueError, match="norm"):
        fk.fused_linear(x, wq, sc, norm=mx.ones((63,)))
    with pytest.raises(ValueError, match="residual"):
        fk.fused_linear(x, wq, sc, residual=mx.zeros((2, 7)))
    with pytest.raises(ValueError, match="mins"):
        fk.fused_linear(x, wq.astype(mx.uint8), sc)
    with pytest.raises(ValueError, match="rows must be"):
        fk.fused_qkv(x, wq, sc, q_heads=2, kv_heads=1, head_dim=4)
    (wq2, sc2, _), _ = weights("q8_0", rng, 16, 64)
    with pytest.raises(ValueError, match="cos"):
        fk.fused_qkv(x, wq2, sc2, q_heads=2, kv_heads=1, head_dim=4, cos=mx.ones((2, 4)))
    with pytest.raises(ValueError, match="cos / sin"):
        fk.fused_qkv(x, wq2, sc2, q_heads=2, kv_heads=1, head_dim=4, cos=mx.ones((3, 4)), sin=mx.ones((3, 4)))
