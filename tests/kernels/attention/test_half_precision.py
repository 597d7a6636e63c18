"""float16 / bfloat16 keys and values: widened on load, bitwise the float32 kernel on the upcast arrays."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.attention.oracle import ISAS, fk, make, mx


def half_inputs(rng, s, hkv, d):
    """keys/values rounded to float16 and bfloat16, with extremes: float16 subnormals and its maximum."""
    k = rng.standard_normal((hkv, s, d)).astype(np.float32) * np.sqrt(d) ** 0.5
    v = rng.standard_normal((hkv, s, d)).astype(np.float32)
    v[:, ::7, 3] = 3e-6  # a float16 subnormal
    v[:, ::11, 5] = -65504.0  # float16's largest magnitude
    v[:, ::13, 1] = 0.0
    v[:, ::17, 2] = -0.0
    return k, v


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_keys_values_equal_float32_kernel_on_upcast_values(dtype):
    """float16 / bfloat16 keys and values are read as stored and widened on load: bitwise the float32
    kernel on the upcast arrays, on every ISA, prefill and decode rows, one part or several."""
    rng = np.random.default_rng(12)
    s, hq, hkv, d = 300, 6, 2, 40  # d % 8 != 0: the tail elements too
    k, v = half_inputs(rng, s, hkv, d)
    kh, vh = mx.array(k).astype(getattr(mx, dtype)), mx.array(v).astype(getattr(mx, dtype))
    k32, v32 = kh.astype(mx.float32), vh.astype(mx.float32)
    q = mx.array((rng.standard_normal((s, hq, d)) * 0.5).astype(np.float32))
    for isa in ISAS:
        fk.set_isa(isa)
        for rows in (slice(0, s), slice(s - 1, s)):
            qp = mx.arange(s)[rows]
            cut = 130
            for parts in ([(0, s)], [(cut, s), (0, cut)]):
                a = fk.causal_attention(
                    q[rows],
                    qp,
                    [kh[:, x:y] for x, y in parts],
                    [vh[:, x:y] for x, y in parts],
                    [mx.arange(x, y) for x, y in parts],
                    scale=d**-0.5,
                )
                b = fk.causal_attention(
                    q[rows],
                    qp,
                    [k32[:, x:y] for x, y in parts],
                    [v32[:, x:y] for x, y in parts],
                    [mx.arange(x, y) for x, y in parts],
                    scale=d**-0.5,
                )
                assert np.array(a).tobytes() == np.array(b).tobytes(), (isa, rows, parts)


def test_mixed_key_dtypes_across_parts_read_as_float32():
    rng = np.random.default_rng(13)
    q, k, v = make(rng, 100, 4, 2, 16)
    kh = mx.array(k).astype(mx.float16)
    vh = mx.array(v).astype(mx.float16)
    k32, v32 = kh.astype(mx.float32), vh.astype(mx.float32)
    args = dict(scale=0.25)
    mixed = fk.causal_attention(
        mx.array(q),
        mx.arange(100),
        [kh[:, :50], k32[:, 50:]],
        [vh[:, :50], v32[:, 50:]],
        [mx.arange(50), mx.arange(50, 100)],
        **args,
    )
    flat = fk.causal_attention(mx.array(q), mx.arange(100), [k32], [v32], [mx.arange(100)], **args)
    assert np.array(mixed).tobytes() == np.array(flat).tobytes()


def test_float16_specials_convert_alike_on_every_isa():
    """Infinities, quiet and signalling NaNs and subnormals in a float16 cache: the scalar widening
    gives the bits F16C's does (outputs compared bytewise, NaNs included)."""
    if fk.best_isa() == "scalar":
        pytest.skip("no AVX2 on this CPU")
    rng = np.random.default_rng(14)
    bits = rng.integers(0, 1 << 16, size=(1, 64, 16), dtype=np.uint16)  # every class of half
    bits[0, :8, 0] = [0x7C00, 0xFC00, 0x7C01, 0x7E00, 0xFE01, 0x0001, 0x83FF, 0x0400]
    v = mx.array(bits).view(mx.float16)
    k = mx.array(rng.standard_normal((1, 64, 16)).astype(np.float16))
    q = mx.array(rng.standard_normal((64, 2, 16)).astype(np.float32))
    outs = []
    for isa in ISAS:
        fk.set_isa(isa)
        outs.append(np.array(fk.causal_attention(q, mx.arange(64), [k], [v], [mx.arange(64)], scale=0.3)))
    assert all(o.tobytes() == outs[0].tobytes() for o in outs)
    # and per value: a one-key softmax (weight exactly 1) returns that key's value, widened
    one = fk.causal_attention(q[:1], mx.array([0]), [k[:, :1]], [v[:, :1]], [mx.array([0])], scale=0.3)
    want = np.array(v[0, 0].astype(mx.float32))
    got = np.array(one)[0, 0]
    finite = np.isfinite(want)
    assert got[finite].tobytes() == want[finite].tobytes()
