"""Several sequences in one attention call (``groups``): each row reads only its own group's keys."""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.attention.oracle import fk, make, mx, run


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
