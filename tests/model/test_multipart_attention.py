"""Attention over a multi-part view (KVView.parts) against the same keys gathered into one view, and
against naive float64 softmax attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.cache.batch_control import KVPart, KVView
from engine_service.model import fast_math
from engine_service.model.random_init import random_tensors, tiny_config
from engine_service.model.transformer import Transformer
from tests.model.reference_cache import ReferenceCache, run

TOKENS = [5, 17, 99, 3, 42, 42, 7, 120, 64, 1, 33, 8, 91, 27]


def _naive(q, keys, values, mask, scale):
    """q [hq, n, D], keys/values [hkv, S, D], mask bool [n, S] -> [hq, n, D] in float64."""
    q, keys, values = (np.asarray(a, dtype=np.float64) for a in (q, keys, values))
    rep = q.shape[0] // keys.shape[0]
    k = np.repeat(keys, rep, axis=0)
    v = np.repeat(values, rep, axis=0)
    s = np.einsum("hnd,hsd->hns", q, k) * scale
    s = np.where(mask[None], s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hns,hsd->hnd", w / w.sum(axis=-1, keepdims=True), v)


@pytest.mark.parametrize("n", [1, 3, 70])
@pytest.mark.parametrize("sizes", [(5, 3), (600, 2, 40)])  # 600 > KEY_BLOCK: chunks inside a part
def test_attention_parts_equals_naive_and_gathered(n, sizes) -> None:
    rng = np.random.default_rng(n + len(sizes))
    hq, hkv, d = 6, 2, 16
    s = sum(sizes)
    q = rng.standard_normal((hq, n, d)).astype(np.float32)
    keys = rng.standard_normal((hkv, s, d)).astype(np.float32)
    values = rng.standard_normal((hkv, s, d)).astype(np.float32)
    mask = rng.random((n, s)) < 0.7
    mask[:, -1] = True  # every row sees a key
    mask[:, : sizes[0]] = mask[:, : sizes[0]] | (n == 1)  # decode: the first part fully visible (None)
    parts, at = [], 0
    for size in sizes:
        m = mask[:, at : at + size]
        part_mask = None if m.all() else mx.array(m)
        parts.append((mx.array(keys[:, at : at + size]), mx.array(values[:, at : at + size]), part_mask))
        at += size
    scale = d**-0.5
    got = np.array(fast_math.attention_parts(mx.array(q), parts, scale))
    want = _naive(q, keys, values, mask, scale)
    np.testing.assert_allclose(got, want, atol=2e-5)
    gathered = np.array(
        fast_math.attention(mx.array(q), mx.array(keys), mx.array(values), scale, mx.array(mask))
    )
    np.testing.assert_allclose(got, gathered, atol=2e-5)
    # negative control: hiding the one key every row sees (in the last part) changes the answer
    k0, v0, _ = parts[-1]
    hidden = mask[:, s - sizes[-1] :].copy()
    hidden[:, -1] = False
    hidden[:, 0] |= ~hidden.any(axis=1)  # keep at least one visible key per row in the part
    wrong = np.array(fast_math.attention_parts(mx.array(q), [*parts[:-1], (k0, v0, mx.array(hidden))], scale))
    assert np.abs(wrong - want).max() > 1e-3


class _SplitStep:
    """Wraps a reference step: each view becomes a multi-part view cut at ``cuts`` (key indices)."""

    def __init__(self, inner, cuts: tuple[int, ...]) -> None:
        self.inner = inner
        self.segments = inner.segments
        self.cuts = cuts
        self.split = 0

    def views(self, layer, keys, values):
        out = []
        for view in self.inner.views(layer, keys, values):
            s = view.keys.shape[1]
            edges = [0, *(c for c in self.cuts if 0 < c < s), s]
            if len(edges) == 2:
                out.append(view)
                continue
            mask = np.array(view.mask)
            parts = []
            for a, b in zip(edges[:-1], edges[1:], strict=True):
                m = mask[:, a:b]
                parts.append(KVPart(view.keys[:, a:b], view.values[:, a:b], None if m.all() else mx.array(m)))
            out.append(KVView(view.rows, None, None, None, parts=tuple(parts)))
            self.split += 1
        return out

    def state(self):
        return self.inner.state()


class _SplitCache(ReferenceCache):
    cuts: tuple[int, ...] = ()

    def begin_step(self, segments):
        self.last = _SplitStep(super().begin_step(segments), self.cuts)
        return self.last


@pytest.mark.parametrize("layers", ["FR", "RF"])
def test_model_over_parts_equals_model_over_gathered_view(layers) -> None:
    config = tiny_config(layers, 3)
    model = Transformer(config, random_tensors(config, seed=4))
    plain = ReferenceCache(config.layers)
    split = _SplitCache(config.layers)
    split.cuts = (3, 9, 12)
    outs = {}
    for name, cache in (("plain", plain), ("split", split)):
        sid = cache.seq_new()
        rows = [run(model, cache, [(sid, 0, TOKENS)], all_rows=True)[0]]  # 14 rows: the online path
        pos = len(TOKENS)
        for tok in (11, 12, 13):  # decode rows: the concatenated-scores path
            rows.append(run(model, cache, [(sid, pos, [tok])], all_rows=True)[0])
            pos += 1
        rows.append(run(model, cache, [(sid, pos, [1, 2, 3])], all_rows=True)[0])  # a few rows
        outs[name] = np.concatenate([np.asarray(r) for r in rows])
        if cache is split:
            assert cache.last.split > 0
    np.testing.assert_allclose(outs["split"], outs["plain"], atol=1e-4, rtol=1e-4)
