"""Drive a cache with random K/V rows (no model) and check its views against naive attention.

The reference keeps, per sequence, the true history of K/V rows by position (numpy fp32) and computes
softmax attention the plain way: a query at position ``q`` reads every earlier row on a full layer and
rows ``q - W < p <= q`` on a sliding layer. Nothing here uses the cache's own masks or positions.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import engine_service  # noqa: F401  (OpenBLAS before mlx)
from engine_service.cache.batch_control import KVView, Segment
from engine_service.cache.config import CacheConfig, LayerSpec
from engine_service.cache.registry import build_cache
from engine_service.model.cpu_kernels import kernels

HEADS = 2
DIM = 8
TOL = 1e-5


def geometry(
    max_write: int, capacity: int = 4096, max_seqs: int = 16, initial: int = 8, ring: bool = True
) -> CacheConfig:
    """Layer 0 flat, layer 1 ring with window 4 (the seed geometry); ``ring=False``: both flat. With the
    compiled kernels' batched K/V write when they load, as an engine's cache has it."""
    return CacheConfig(
        kv_store=getattr(kernels(), "kv_store", None),
        capacity=capacity,
        max_seqs=max_seqs,
        layers=(LayerSpec(), LayerSpec("sliding", 4) if ring else LayerSpec()),
        kv_heads=HEADS,
        head_dim=DIM,
        initial_capacity=initial,
        max_write=max_write,
    )


def naive_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, qpos: int, window: int | None):
    """q: [heads, dim]; keys/values: [P, heads, dim] = true history rows 0..P-1. Returns [heads, dim]."""
    lo = 0 if window is None else max(0, qpos - window + 1)
    k = keys[lo : qpos + 1].astype(np.float64)  # [n, heads, dim]
    v = values[lo : qpos + 1].astype(np.float64)
    scores = np.einsum("hd,nhd->hn", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    w = np.exp(scores - scores.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return np.einsum("hn,nhd->hd", w, v)


def view_attention(views: list[KVView], q: np.ndarray) -> np.ndarray:
    """Attend packed queries q: [T, heads, dim] through the cache's views. Returns [T, heads, dim]."""
    out = np.full(q.shape, np.nan)
    for view in views:
        qs = q[view.rows].astype(np.float64)  # [n, heads, dim]
        n = qs.shape[0]
        if view.parts is not None:  # a multi-part view means the concatenation of its parts
            assert view.keys is None and view.values is None and view.mask is None
            keys = np.concatenate([np.array(p.keys, dtype=np.float64) for p in view.parts], axis=1)
            values = np.concatenate([np.array(p.values, dtype=np.float64) for p in view.parts], axis=1)
            masks = []
            for p in view.parts:
                k = p.keys.shape[1]
                assert p.values.shape == p.keys.shape
                masks.append(np.ones((n, k), dtype=bool) if p.mask is None else np.array(p.mask, dtype=bool))
                assert masks[-1].shape == (n, k)
            mask = np.concatenate(masks, axis=1)
        else:
            keys = np.array(view.keys, dtype=np.float64)  # [heads, S, dim]
            values = np.array(view.values, dtype=np.float64)
            mask = None
        s = keys.shape[1]
        if mask is not None:  # from the parts
            pass
        elif view.mask is None:
            mask = np.ones((n, s), dtype=bool)
        elif isinstance(view.mask, str):
            assert view.mask == "causal"
            mask = np.arange(s)[None, :] <= (s - n + np.arange(n))[:, None]
        else:
            mask = np.array(view.mask, dtype=bool)
        assert mask.shape == (n, s)
        scores = np.einsum("nhd,hsd->nhs", qs, keys) / np.sqrt(q.shape[-1])
        scores = np.where(mask[:, None, :], scores, -np.inf)
        w = np.exp(scores - scores.max(axis=2, keepdims=True))
        w /= w.sum(axis=2, keepdims=True)
        out[view.rows] = np.einsum("nhs,hsd->nhd", w, values)
    assert not np.isnan(out).any(), "views did not cover every packed row"
    return out


def position_attention(
    views: list[KVView], q: np.ndarray, qpos: np.ndarray, window: int | None
) -> np.ndarray:
    """As :func:`view_attention`, but each row reads the keys whose ``positions`` lie in its window
    (what the deterministic attention does), ignoring the masks. qpos: [T] each row's position."""
    out = np.full(q.shape, np.nan)
    for view in views:
        parts = view.parts if view.parts is not None else (view,)
        assert all(p.positions is not None for p in parts), "every view / part carries positions"
        keys = np.concatenate([np.array(p.keys, dtype=np.float64) for p in parts], axis=1)
        values = np.concatenate([np.array(p.values, dtype=np.float64) for p in parts], axis=1)
        pos = np.concatenate([np.array(p.positions) for p in parts])
        assert pos.dtype == np.int32 and pos.shape == (keys.shape[1],)
        valid = pos[pos >= 0]
        assert len(np.unique(valid)) == len(valid), "a sequence holds each position once"
        p = qpos[view.rows][:, None]
        lo = 0 if window is None else p - window + 1
        mask = (pos[None, :] >= 0) & (pos[None, :] <= p) & (pos[None, :] >= lo)
        scores = np.einsum("nhd,hsd->nhs", q[view.rows].astype(np.float64), keys) / np.sqrt(q.shape[-1])
        scores = np.where(mask[:, None, :], scores, -np.inf)
        w = np.exp(scores - scores.max(axis=2, keepdims=True))
        w /= w.sum(axis=2, keepdims=True)
        out[view.rows] = np.einsum("nhs,hsd->nhd", w, values)
    assert not np.isnan(out).any(), "views did not cover every packed row"
    return out


class Driver:
    """A cache plus the true per-sequence history, with one method per operation.

    ``history[seq]`` is a list of K/V rows (each [layers, 2, heads, dim]) of what the sequence must see.
    ``step`` writes random rows and returns the max abs difference to naive attention over all layers.
    """

    def __init__(self, kind: str, config: CacheConfig, seed: int = 0) -> None:
        self.kind = kind
        self.config = config
        self.cache = build_cache(kind, config)
        self.rng = np.random.default_rng(seed)
        self.history: dict[int, list[np.ndarray]] = {}

    def new(self) -> int | None:
        sid = self.cache.seq_new()
        if sid is not None:
            self.history[sid] = []
        return sid

    def clone(self, src: int, upto: int) -> int | None:
        sid = self.cache.seq_clone(src, upto)
        if sid is not None:
            self.history[sid] = list(self.history[src][:upto])
        return sid

    def rm(self, seq: int) -> None:
        self.cache.seq_rm(seq)
        del self.history[seq]

    def rewind(self, seq: int, length: int) -> bool:
        ok = self.cache.rewind(seq, length)
        if ok:
            del self.history[seq][length:]
        return ok

    def step(
        self, lengths: dict[int, int], rows: np.ndarray | None = None, q: np.ndarray | None = None
    ) -> float:
        """One packed step appending ``lengths[seq]`` rows to each seq; returns the worst error.

        rows: [T, layers, 2, heads, dim] and q: [T, layers, heads, dim] (random when omitted). The
        cache's attention outputs [T, layers, heads, dim] are left in ``self.last``.
        """
        cfg = self.config
        segs = [Segment(s, self.cache.pos(s), n) for s, n in lengths.items()]
        total = sum(lengths.values())
        shape = (total, len(cfg.layers), cfg.kv_heads, cfg.head_dim)
        if rows is None:
            rows = self.rng.standard_normal((shape[0], shape[1], 2, *shape[2:])).astype(np.float32)
        if q is None:
            q = self.rng.standard_normal(shape).astype(np.float32)
        step = self.cache.begin_step(segs)
        offset = 0
        for seg in segs:
            self.history[seg.seq].extend(rows[offset : offset + seg.length])
            offset += seg.length
        worst = 0.0
        qpos = np.concatenate([np.arange(seg.start, seg.start + seg.length) for seg in segs])
        self.last = np.zeros(shape)
        self.last_views: list[list[KVView]] = []  # per layer, what the cache returned
        for layer, spec in enumerate(cfg.layers):
            views = step.views(layer, mx.array(rows[:, layer, 0]), mx.array(rows[:, layer, 1]))
            self.last_views.append(list(views))
            got = view_attention(list(views), q[:, layer])
            by_pos = position_attention(list(views), q[:, layer], qpos, spec.window)
            worst = max(worst, float(np.abs(got - by_pos).max()))
            self.last[:, layer] = got
            offset = 0
            for seg in segs:
                hist = np.stack(self.history[seg.seq])  # [P, layers, 2, heads, dim]
                for i in range(seg.length):
                    want = naive_attention(
                        q[offset + i, layer], hist[:, layer, 0], hist[:, layer, 1], seg.start + i, spec.window
                    )
                    worst = max(worst, float(np.abs(got[offset + i] - want).max()))
                offset += seg.length
        mx.eval(step.state())
        return worst

    def probe(self, seq: int, seed: int = 12345) -> float:
        """Check what ``seq`` sees without changing it: append one row to a full clone, compare, drop it.

        The probe row and query come from ``seed``, so two probes of an unchanged sequence read the
        same; the outputs are left in ``self.last``.
        """
        probe = self.clone(seq, self.cache.pos(seq))
        assert probe is not None, "a full-length clone must succeed in these tests"
        cfg = self.config
        rng = np.random.default_rng(seed)
        shape = (1, len(cfg.layers), cfg.kv_heads, cfg.head_dim)
        rows = rng.standard_normal((1, shape[1], 2, *shape[2:])).astype(np.float32)
        q = rng.standard_normal(shape).astype(np.float32)
        try:
            return self.step({probe: 1}, rows, q)
        finally:
            self.rm(probe)

    def fill(self, seq: int, n: int, chunk: int | None = None) -> float:
        """Append ``n`` random rows to ``seq`` in steps of at most ``chunk`` (default max_write)."""
        chunk = chunk or self.config.max_write
        worst = 0.0
        while n > 0:
            k = min(n, chunk)
            worst = max(worst, self.step({seq: k}))
            n -= k
        return worst
