"""A deliberately naive KV cache for model tests, independent of engine_service/cache.

Per sequence and layer it keeps a Python list of K/V rows (one [kv_heads, D] array per position),
concatenates them for every view and builds the mask by hand from the layer's window:
query at position q sees key position p iff p <= q and (full layer or p > q - window).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from engine_service.cache.batch_control import KVView, Segment
from engine_service.cache.config import LayerSpec


class ReferenceStep:
    def __init__(self, cache: ReferenceCache, segments: Sequence[Segment]) -> None:
        self.cache = cache
        self.segments = list(segments)
        self._produced: list[mx.array] = []

    def views(self, layer: int, keys: mx.array, values: mx.array) -> list[KVView]:
        spec = self.cache.layers[layer]
        out = []
        offset = 0
        for seg in self.segments:
            ks, vs = self.cache.rows[seg.seq][layer]
            del ks[seg.start :], vs[seg.start :]
            for j in range(seg.length):
                ks.append(keys[offset + j])
                vs.append(values[offset + j])
            k_all = mx.stack(ks).transpose(1, 0, 2)  # [kv_heads, S, D]
            v_all = mx.stack(vs).transpose(1, 0, 2)
            qpos = np.arange(seg.start, seg.start + seg.length)[:, None]
            kpos = np.arange(len(ks))[None, :]
            mask = kpos <= qpos
            if self.cache.ignore_window is False and spec.sliding:
                mask &= kpos > qpos - spec.window
            out.append(KVView(slice(offset, offset + seg.length), k_all, v_all, mx.array(mask)))
            self._produced += [k_all, v_all]
            offset += seg.length
        return out

    def state(self) -> list[mx.array]:
        return self._produced


class ReferenceCache:
    """Enough of BatchControl for model tests. ``ignore_window=True`` is a broken cache (negative control)."""

    def __init__(self, layers: Sequence[LayerSpec], ignore_window: bool = False) -> None:
        self.layers = tuple(layers)
        self.ignore_window = ignore_window
        self.rows: dict[int, list[tuple[list, list]]] = {}
        self._next = 0

    def seq_new(self) -> int:
        sid = self._next
        self._next += 1
        self.rows[sid] = [([], []) for _ in self.layers]
        return sid

    def seq_clone(self, src: int, upto: int) -> int:
        sid = self.seq_new()
        self.rows[sid] = [(ks[:upto], vs[:upto]) for ks, vs in self.rows[src]]
        return sid

    def pos(self, seq: int) -> int:
        return len(self.rows[seq][0][0])

    def begin_step(self, segments: Sequence[Segment]) -> ReferenceStep:
        for seg in segments:
            if seg.start > self.pos(seg.seq):
                raise ValueError(f"gap: segment {seg} but sequence is at {self.pos(seg.seq)}")
        return ReferenceStep(self, segments)


def run(
    model, cache: ReferenceCache, pieces: Sequence[tuple[int, int, Sequence[int]]], *, all_rows: bool = False
):
    """One packed forward. pieces: (seq, start, tokens). Returns logits per piece: [len(tokens), vocab]
    (all rows) or [vocab] (last row)."""
    segments = [Segment(seq, start, len(toks)) for seq, start, toks in pieces]
    step = cache.begin_step(segments)
    tokens = mx.array([t for _, _, toks in pieces for t in toks], dtype=mx.int32)
    positions = mx.array([start + j for _, start, toks in pieces for j in range(len(toks))], dtype=mx.int32)
    logits = model(step, positions, tokens=tokens)
    mx.eval(logits, *step.state())
    out, offset = [], 0
    for _, _, toks in pieces:
        rows = logits[offset : offset + len(toks)]
        out.append(rows if all_rows else rows[-1])
        offset += len(toks)
    return out
