"""``forkline_kernels.DecoderLayer``: one decoder layer as one op (a layer's first call builds and checks it
in full, later calls reuse its fixed arguments), against the six ops it replaces
(``fused_qkv``, ``kv_store``, ``causal_attention`` over slices of the stored buffers, and three
``fused_linear``) built by hand from the same arrays: bitwise equal outputs and buffers, with two
segments (groups), a given part beside a buffer's rows, float16 K/V; a buffer updated in place when
nothing else holds it; bad arguments raise ValueError naming what is wrong. Negative control: the
same comparison catches a part that reads one row fewer."""

from __future__ import annotations

import numpy as np
import pytest

import engine_service  # noqa: F401  (OpenBLAS before mlx)

mx = pytest.importorskip("mlx.core")
fk = pytest.importorskip("forkline_kernels", reason="compiled kernels not built (scripts/setup.sh)")
if getattr(fk, "DecoderLayer", None) is None:
    pytest.skip("forkline_kernels predates DecoderLayer: rebuild (scripts/setup.sh)", allow_module_level=True)

from tests.kernels.test_fused import weights  # noqa: E402
from tests.kernels.test_kv_store import address  # noqa: E402

HQ, HKV, D, HIDDEN, INTER, EPS = 4, 2, 32, 128, 96, 1e-5


def setup(fmt: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    f = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    t = 3  # segment 0: rows 0-1 (prefill), segment 1: row 2 (decode)
    cos, sin = f(t, D), f(t, D)
    return dict(
        h=f(t, HIDDEN),
        qkv=weights(fmt, rng, (HQ + 2 * HKV) * D, HIDDEN)[0],
        o=weights(fmt, rng, HIDDEN, HQ * D)[0],
        gate_up=weights(fmt, rng, 2 * INTER, HIDDEN)[0],
        down=weights(fmt, rng, HIDDEN, INTER)[0],
        attn_norm=f(HIDDEN) + 1.0,
        mlp_norm=f(HIDDEN) + 1.0,
        post_attn_norm=f(HIDDEN) + 1.0,
        q_norm=f(D) + 1.0,
        k_norm=f(D) + 1.0,
        cos=cos,
        sin=sin,
        keys=[f(HKV, 8, D).astype(mx.float16), f(HKV, 16, D).astype(mx.float16)],
        values=[f(HKV, 8, D).astype(mx.float16), f(HKV, 16, D).astype(mx.float16)],
        piece_keys=f(HKV, 5, D).astype(mx.float16),
        piece_values=f(HKV, 5, D).astype(mx.float16),
        q_pos=mx.array([3, 4, 9], dtype=mx.int32),
    )


# segment 0 writes its 2 rows at buffer rows 3-4 (positions 3, 4); segment 1 has positions 0-4 in a
# shared piece and its own buffer from position 5, writing position 9 at row 4
WRITES = [(0, 0, 3, 2), (1, 2, 4, 1)]
GROUPS = [(0, 2, 1), (2, 3, 2)]


def parts(s: dict, rows0: int = 5, rows1: int = 5) -> list[tuple]:
    return [
        (0, 0, rows0, None, None, mx.arange(rows0, dtype=mx.int32)),
        (-1, 0, 0, s["piece_keys"], s["piece_values"], mx.arange(5, dtype=mx.int32)),
        (1, 0, rows1, None, None, mx.arange(5, 5 + rows1, dtype=mx.int32)),
    ]


def by_six_ops(s: dict, part_list: list[tuple] | None = None) -> tuple:
    q, k, v = fk.fused_qkv(
        s["h"], *s["qkv"], q_heads=HQ, kv_heads=HKV, head_dim=D, norm=s["attn_norm"], eps=EPS,
        q_norm=s["q_norm"], k_norm=s["k_norm"], qk_eps=EPS, cos=s["cos"], sin=s["sin"], kv_dtype=mx.float16,
    )  # fmt: skip
    keys, values = fk.kv_store(k, v, s["keys"], s["values"], WRITES)
    part_list = part_list if part_list is not None else parts(s)
    ks = [keys[b][:, a : a + n] if b >= 0 else pk for b, a, n, pk, _, _ in part_list]
    vs = [values[b][:, a : a + n] if b >= 0 else pv for b, a, n, _, pv, _ in part_list]
    pos = [p[5] for p in part_list]
    a = fk.causal_attention(q, s["q_pos"], ks, vs, pos, scale=D**-0.5, window=0, chunk=64, groups=GROUPS)
    h1 = fk.fused_linear(
        a.reshape(3, -1), *s["o"], post_norm=s["post_attn_norm"], post_eps=EPS, residual=s["h"]
    )
    m = fk.fused_linear(h1, *s["gate_up"], norm=s["mlp_norm"], eps=EPS, act="gelu_tanh")
    out = fk.fused_linear(m, *s["down"], residual=h1)
    return out, keys, values


def held(s: dict):
    return fk.DecoderLayer(
        s["qkv"], q_heads=HQ, kv_heads=HKV, head_dim=D, attn_norm=s["attn_norm"], eps=EPS, q_norm=s["q_norm"],
        k_norm=s["k_norm"], scale=D**-0.5, o=s["o"], post_attn_norm=s["post_attn_norm"], gate_up=s["gate_up"],
        mlp_norm=s["mlp_norm"], act="gelu_tanh", down=s["down"],
    )  # fmt: skip


def call_held(layer, s: dict, part_list: list[tuple] | None = None) -> tuple:
    part_list = part_list if part_list is not None else parts(s)
    return layer(s["h"], s["cos"], s["sin"], s["keys"], s["values"], WRITES, s["q_pos"], part_list, GROUPS)


def by_layer_op(s: dict, part_list: list[tuple] | None = None) -> tuple:
    """A fresh layer's first call: the op built and checked in full."""
    return call_held(held(s), s, part_list)


def same(a: mx.array, b: mx.array) -> bool:
    return np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_one_op_equals_the_six_it_replaces(fmt):
    want = by_six_ops(setup(fmt))
    out, keys, values = by_layer_op(setup(fmt))
    assert same(out, want[0])
    assert all(same(g, w) for g, w in zip([*keys, *values], [*want[1], *want[2]], strict=True))
    # control: a part that reads one row fewer changes the output, so the comparison can fail
    s = setup(fmt)
    short, _, _ = by_layer_op(s, parts(s, rows1=4))
    assert not same(short, want[0])


def test_a_part_may_start_inside_its_buffer():
    """Rows [1, 5) of segment 1's buffer (a cell pool's run), on the first and a later held call."""
    s = setup("q4_1")
    later = [*parts(s)[:2], (1, 1, 4, None, None, mx.arange(6, 10, dtype=mx.int32))]
    want = by_six_ops(s, later)
    layer = held(setup("q4_1"))
    call_held(layer, setup("q4_1"))
    for got in (by_layer_op(setup("q4_1"), later), call_held(layer, setup("q4_1"), later)):
        assert same(got[0], want[0])
    assert not same(want[0], by_six_ops(setup("q4_1"))[0])  # control: the start changed what is read


def test_buffers_are_updated_in_place_when_nothing_else_holds_them():
    s = setup("q4_1")
    keys = [b + 0 for b in s.pop("keys")]
    mx.eval(keys)
    before = [address(b) for b in keys]
    s["keys"] = keys
    del keys
    out, new_keys, _ = by_layer_op(s)
    del s["keys"]
    mx.eval(out, *new_keys)
    assert [address(b) for b in new_keys] == before


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: [(5, 0, 5, None, None, p[0][5]), *p[1:]], "buffer index"),
        (lambda p: [(-1, 0, 0, None, None, p[0][5]), *p[1:]], "needs keys and values"),
        (lambda p: [(0, 0, 99, None, None, p[0][5]), *p[1:]], "rows within it"),
        (lambda p: [(0, 6, 5, None, None, p[0][5]), *p[1:]], "rows within it"),
    ],
)
def test_bad_parts_raise_value_error(change, message):
    s = setup("q8_0")
    with pytest.raises(ValueError, match=message):
        by_layer_op(s, change(parts(s)))


def test_bad_shapes_raise_value_error():
    s = setup("q8_0")
    s["h"] = s["h"][None]
    with pytest.raises(ValueError, match="h must be"):
        by_layer_op(s)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_a_held_layer_equals_the_six_ops_on_every_call(fmt):
    """The first call builds the op in full, later ones from what it kept: all equal the six ops."""
    want = by_six_ops(setup(fmt))
    layer = held(setup(fmt))
    for _ in range(3):
        out, keys, values = call_held(layer, setup(fmt))
        assert same(out, want[0])
        assert all(same(g, w) for g, w in zip([*keys, *values], [*want[1], *want[2]], strict=True))
    s = setup(fmt)
    short, _, _ = call_held(layer, s, parts(s, rows1=4))  # control, on the kept path
    assert not same(short, want[0])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s, p: (s, [(5, 0, 5, None, None, p[0][5]), *p[1:]]), "buffer index"),
        (lambda s, p: (s, [(-1, 0, 0, None, None, p[0][5]), *p[1:]]), "needs keys and values"),
        (lambda s, p: (s, [(0, 0, 99, None, None, p[0][5]), *p[1:]]), "rows within it"),
        (lambda s, p: (s, [(0, 4, 5, None, None, p[0][5]), *p[1:]]), "rows within it"),
        (lambda s, p: (s, [(0, 0, 4, None, None, p[0][5]), *p[1:]]), "key_pos must be"),
        (lambda s, p: ({**s, "h": s["h"][:, :64]}, p), "h must be"),
        (lambda s, p: ({**s, "keys": [s["keys"][0], s["keys"][0]]}, p), "distinct"),
    ],
)
def test_a_held_layer_checks_what_changes_per_call(change, message):
    layer = held(setup("q8_0"))
    call_held(layer, setup("q8_0"))  # the full build: what the later calls keep
    s = setup("q8_0")
    s, part_list = change(s, parts(s))
    with pytest.raises(ValueError, match=message):
        call_held(layer, s, part_list)
