"""Bitwise batch invariance of the causal attention op: a query alone vs in batches and whole prefills,
a prefill split at unaligned points vs unsplit, keys in any row order / several parts / ring slots,
thread counts. The negative control shows MLX's own attention is not batch-invariant.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.attention.oracle import fk, make, mx, reference, run


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
