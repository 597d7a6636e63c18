"""The batch-invariant causal attention op (kernels/src/attention.cpp).

Checked against a float64 numpy attention over the keys each query may see (by absolute position),
then for bitwise invariance: a query alone vs in batches and whole prefills, a prefill split at
unaligned points vs unsplit, keys in any row order / several parts / ring slots, thread counts, and the
scalar vs AVX2 paths. The negative control shows MLX's own attention is not batch-invariant.
"""

from __future__ import annotations

import numpy as np
import pytest

import engine_service  # noqa: F401  (OpenBLAS before mlx)

mx = pytest.importorskip("mlx.core")
fk = pytest.importorskip("forkline_kernels", reason="compiled kernels not built (scripts/setup.sh)")
if not hasattr(fk, "causal_attention"):
    pytest.skip(
        "forkline_kernels predates causal_attention: rebuild (scripts/setup.sh)", allow_module_level=True
    )


@pytest.fixture(autouse=True)
def _restore_kernel_state():
    threads = fk.num_threads()
    yield
    fk.set_isa(fk.best_isa())
    fk.set_num_threads(threads)


def reference(q, q_pos, keys, values, key_pos, scale, window):
    """float64: q [n, Hq, D]; keys/values [Hkv, S, D]; key_pos [S] -> [n, Hq, D]."""
    n, hq, d = q.shape
    rep = hq // keys.shape[0]
    out = np.full((n, hq, d), np.nan)
    for i, p in enumerate(q_pos):
        lo = max(0, p - window + 1) if window else 0
        vis = (key_pos >= lo) & (key_pos <= p) & (key_pos >= 0)
        if not vis.any():
            continue
        for h in range(hq):
            k = keys[h // rep][vis].astype(np.float64)
            v = values[h // rep][vis].astype(np.float64)
            s = scale * (k @ q[i, h].astype(np.float64))
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v
    return out


def run(q, q_pos, parts, scale, window=0, chunk=64):
    """parts: [(keys, values, key_pos)] as numpy."""
    o = fk.causal_attention(
        mx.array(q),
        mx.array(np.asarray(q_pos, dtype=np.int32)),
        [mx.array(k) for k, _, _ in parts],
        [mx.array(v) for _, v, _ in parts],
        [mx.array(np.asarray(p, dtype=np.int32)) for _, _, p in parts],
        scale=scale,
        window=window,
        chunk=chunk,
    )
    return np.array(o)


def make(rng, s, hq, hkv, d, spread=3.0):
    """q [s, Hq, D] and keys/values [Hkv, s, D] for positions 0..s-1 (spread: score magnitude)."""
    q = (rng.standard_normal((s, hq, d)) * spread / np.sqrt(d) ** 0.5).astype(np.float32)
    k = (rng.standard_normal((hkv, s, d)) * np.sqrt(d) ** 0.5).astype(np.float32)
    v = rng.standard_normal((hkv, s, d)).astype(np.float32)
    return q, k, v


CASES = [  # (rows, keys, Hq, Hkv, D, window, chunk)
    (1, 1, 1, 1, 8, 0, 64),
    (7, 40, 6, 2, 64, 0, 64),
    (33, 300, 9, 3, 64, 0, 64),
    (16, 100, 4, 4, 20, 0, 7),
    (20, 130, 18, 2, 32, 0, 16),  # 9 q heads per kv head: more than one group of 8
    (40, 200, 6, 3, 64, 17, 8),
    (5, 90, 2, 1, 12, 1, 64),
    (3, 150, 8, 2, 256, 0, 64),  # Gemma 3's head_dim, 4 q heads per kv head
    (2, 70, 5, 1, 40, 0, 64),  # 5 per kv head; head_dim 40 (a 16-float tail of 8)
]


LEVELS = ["scalar", "avx2", "avx512"]
ISAS = LEVELS[: LEVELS.index(fk.best_isa()) + 1]  # the ones this CPU runs


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


def test_row_with_no_visible_key_is_nan():
    rng = np.random.default_rng(4)
    q, k, v = make(rng, 4, 2, 1, 8)
    out = run(q[:2], [1, 3], [(k, v, np.array([-1, -1, 2, 3]))], 0.3)
    assert np.isnan(out[0]).all() and not np.isnan(out[1]).any()


@pytest.fixture(scope="module")
def prefill():
    """A 600-position sequence (q heads 9 on 3 kv heads, D 64, as SmolLM2) and its whole-prefill output."""
    rng = np.random.default_rng(5)
    s = 600
    q, k, v = make(rng, s, 9, 3, 64)
    full = run(q, np.arange(s), [(k, v, np.arange(s))], 0.125)
    return q, k, v, full


def test_query_alone_equals_query_in_any_batch(prefill):
    """Each row computed alone (keys up to its position only), in batches of 8 and 64, and in the whole
    prefill: bitwise the same."""
    q, k, v, full = prefill
    for p in (0, 1, 63, 64, 65, 130, 511, 599):
        alone = run(q[p : p + 1], [p], [(k[:, : p + 1], v[:, : p + 1], np.arange(p + 1))], 0.125)
        assert alone.tobytes() == full[p : p + 1].tobytes(), p
    for size in (8, 64):
        for a in (0, 5, 100, 600 - size):
            got = run(
                q[a : a + size],
                np.arange(a, a + size),
                [(k[:, : a + size], v[:, : a + size], np.arange(a + size))],
                0.125,
            )
            assert got.tobytes() == full[a : a + size].tobytes(), (size, a)


@pytest.mark.parametrize("cuts", [(37,), (1, 2, 3), (100, 227, 450), (63, 64, 129, 599)])
def test_split_prefill_equals_unsplit(prefill, cuts):
    """A prefill in pieces ending at arbitrary (unaligned) points, each piece seeing the keys written so
    far (and stale junk rows past them marked -1), equals the one-piece prefill bit for bit."""
    q, k, v, full = prefill
    edges = [0, *cuts, 600]
    pieces = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        kp = np.where(np.arange(600) < b, np.arange(600), -1)  # rows past the piece: not yet written
        pieces.append(run(q[a:b], np.arange(a, b), [(k, v, kp)], 0.125))
    assert np.concatenate(pieces).tobytes() == full.tobytes()


def test_key_order_parts_and_invalid_rows_do_not_matter(prefill):
    """The same keys shuffled, split into parts, padded with invalid (-1) rows: bitwise the same."""
    q, k, v, full = prefill
    rng = np.random.default_rng(6)
    perm = rng.permutation(600)
    junk_k = rng.standard_normal((3, 50, 64)).astype(np.float32)
    kk = np.concatenate([k[:, perm], junk_k], axis=1)
    vv = np.concatenate([v[:, perm], junk_k], axis=1)
    kp = np.concatenate([perm, np.full(50, -1)])
    rows = np.array([0, 64, 200, 599])
    shuffled = run(q[rows], rows, [(kk, vv, kp)], 0.125)
    assert shuffled.tobytes() == full[rows].tobytes()
    cut = [0, 120, 121, 400, 650]
    parts = [(kk[:, a:b], vv[:, a:b], kp[a:b]) for a, b in zip(cut[:-1], cut[1:], strict=True)][::-1]
    assert run(q[rows], rows, parts, 0.125).tobytes() == full[rows].tobytes()


@pytest.mark.parametrize("window", [1, 50, 64, 100])
def test_ring_slots_equal_flat_layout(window):
    """A sliding-window layer stored as a ring (slot = position % slots, older positions overwritten)
    equals the flat layout with the window, and the float64 reference."""
    rng = np.random.default_rng(window)
    s, slots = 400, window + 31
    q, k, v = make(rng, s, 6, 2, 32)
    flat = run(q, np.arange(s), [(k, v, np.arange(s))], 0.2, window, 16)
    np.testing.assert_allclose(
        flat, reference(q, np.arange(s), k, v, np.arange(s), 0.2, window), atol=2e-5 * 4
    )
    for a, b in [(0, 1), (200, 232), (368, 400), (399, 400)]:  # steps of at most slots - window + 1 rows
        ring_k = np.zeros((2, slots, 32), np.float32)
        ring_v = np.zeros((2, slots, 32), np.float32)
        ring_pos = np.full(slots, -1)
        for p in range(b):  # everything written up to the step's end, as the cache does
            ring_k[:, p % slots], ring_v[:, p % slots], ring_pos[p % slots] = k[:, p], v[:, p], p
        got = run(q[a:b], np.arange(a, b), [(ring_k, ring_v, ring_pos)], 0.2, window, 16)
        assert got.tobytes() == flat[a:b].tobytes(), (window, a, b)


def test_thread_count_does_not_change_results(prefill):
    q, k, v, full = prefill
    fk.set_num_threads(1)
    one = run(q, np.arange(600), [(k, v, np.arange(600))], 0.125)
    fk.set_num_threads(3)
    three = run(q, np.arange(600), [(k, v, np.arange(600))], 0.125)
    assert one.tobytes() == full.tobytes() == three.tobytes()


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


def test_negative_control_mlx_attention_is_not_batch_invariant(prefill):
    """MLX's fused attention: a row computed alone differs from the same row inside a prefill block (which
    is why the deterministic mode needs the op above)."""
    q, k, v, _ = prefill
    qt = mx.array(q.transpose(1, 0, 2))[None]  # [1, Hq, 600, D]
    kt, vt = mx.array(k)[None], mx.array(v)[None]
    block = np.array(mx.fast.scaled_dot_product_attention(qt, kt, vt, scale=0.125, mask="causal"))[0]
    differ = 0
    for p in range(64, 600, 41):
        alone = mx.fast.scaled_dot_product_attention(
            qt[:, :, p : p + 1], kt[:, :, : p + 1], vt[:, :, : p + 1], scale=0.125
        )
        differ += np.array(alone)[0, :, 0].tobytes() != block[:, p].tobytes()
    assert differ > 0


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


@pytest.mark.parametrize("hq,hkv,d,window", [(9, 3, 64, 0), (4, 1, 256, 0), (4, 1, 256, 512)])
def test_decode_row_split_over_threads_equals_the_row_in_a_batch(hq, hkv, d, window):
    """A decode row over thousands of keys (SmolLM2's and Gemma 3's head layouts): its chunks are spread
    over the pool's threads and their partials folded in ascending order -- bitwise the row computed as
    one unit (one thread), inside a 64-row batch, and as a float16 cache read vs its upcast."""
    rng = np.random.default_rng(hq * d)
    s = 4100
    q, k, v = make(rng, s, hq, hkv, d)
    rows = np.arange(s - 64, s)
    batch = run(q[rows], rows, [(k, v, np.arange(s))], d**-0.5, window)
    for threads in (1, 2, 3):
        fk.set_num_threads(threads)
        for p in (s - 64, s - 1):
            alone = run(
                q[p : p + 1], [p], [(k[:, : p + 1], v[:, : p + 1], np.arange(p + 1))], d**-0.5, window
            )
            assert alone.tobytes() == batch[p - (s - 64)][None].tobytes(), (threads, p)
    np.testing.assert_allclose(
        batch[-1:], reference(q[-1:], [s - 1], k, v, np.arange(s), d**-0.5, window), rtol=0, atol=2e-5 * 4
    )


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


@pytest.mark.parametrize("threads", [1, 2])
def test_groups_of_rows_equal_one_call_per_group(threads):
    """Several sequences in one call (``groups``: each group's rows read only its own parts, e.g. a
    batched decode step): every row bitwise what the group's own call gives, decode rows over thousands
    of keys (split over threads) and prefill rows alike, float16 and multi-part views included."""
    if not getattr(fk, "attention_groups", False):
        pytest.skip("forkline_kernels predates attention groups")
    fk.set_num_threads(threads)
    rng = np.random.default_rng(12)
    hq, hkv, d = 9, 3, 64
    seqs = []  # (q rows, q positions, parts)
    for s, rows in ((3000, 1), (40, 1), (200, 5), (1500, 1)):
        q, k, v = make(rng, s, hq, hkv, d)
        k, v = k.astype(np.float16), v.astype(np.float16)
        pos = np.arange(s - rows, s)
        cut = s // 3  # two parts: keys [0, cut) and [cut, s)
        parts = [(k[:, :cut], v[:, :cut], np.arange(cut)), (k[:, cut:], v[:, cut:], np.arange(cut, s))]
        seqs.append((q[pos], pos, parts))
    want = [run(q, pos, parts, d**-0.5) for q, pos, parts in seqs]
    groups, at = [], 0
    for q, _, parts in seqs:
        groups.append((at, at + q.shape[0], len(parts)))
        at += q.shape[0]
    all_parts = [p for _, _, parts in seqs for p in parts]
    got = np.array(
        fk.causal_attention(
            mx.array(np.concatenate([q for q, _, _ in seqs])),
            mx.array(np.concatenate([pos for _, pos, _ in seqs]).astype(np.int32)),
            [mx.array(k) for k, _, _ in all_parts],
            [mx.array(v) for _, v, _ in all_parts],
            [mx.array(p.astype(np.int32)) for _, _, p in all_parts],
            scale=d**-0.5,
            groups=groups,
        )
    )
    assert got.tobytes() == np.concatenate(want).tobytes()
    # negative control: without groups every row reads every sequence's keys
    mixed = run(
        np.concatenate([q for q, _, _ in seqs]),
        np.concatenate([pos for _, pos, _ in seqs]),
        all_parts,
        d**-0.5,
    )
    assert mixed.tobytes() != got.tobytes()


def test_bad_groups_raise():
    if not getattr(fk, "attention_groups", False):
        pytest.skip("forkline_kernels predates attention groups")
    rng = np.random.default_rng(13)
    q, k, v = make(rng, 8, 2, 1, 8)
    args = (mx.array(q[:4]), mx.array(np.arange(4, 8, dtype=np.int32)), [mx.array(k)] * 2, [mx.array(v)] * 2,
            [mx.array(np.arange(8, dtype=np.int32))] * 2)  # fmt: skip
    for groups in ([(0, 2, 1), (3, 4, 1)], [(0, 2, 1), (2, 4, 2)], [(0, 4, 1)], [(0, 2, 0), (2, 4, 2)]):
        with pytest.raises(ValueError, match="groups"):
            fk.causal_attention(*args, scale=0.5, groups=groups)
