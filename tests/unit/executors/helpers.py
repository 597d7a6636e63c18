"""Shared helpers: an independent greedy reference (the naive reference cache) and executor drivers."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from engine_service.executors.base import ExecInput
from tests.model.reference_cache import ReferenceCache, run


def reference_greedy(model, tokens: Sequence[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy continuation of ``tokens`` by n steps with the naive cache: (tokens, logits behind each)."""
    cache = ReferenceCache(model.config.layers)
    seq = cache.seq_new()
    logits = run(model, cache, [(seq, 0, list(tokens))])[0]
    out, rows = [], []
    for _ in range(n):
        rows.append(np.array(logits))
        tok = int(mx.argmax(logits))
        out.append(tok)
        logits = run(model, cache, [(seq, len(tokens) + len(out) - 1, [tok])])[0]
    return out, rows


def prefill(ex, sid: int, tokens: Sequence[int], start: int = 0) -> tuple[int, ...]:
    out = ex.execute([ExecInput(sid, start, tokens=tuple(tokens))])[0]
    assert out.error is None, out.error
    return out.tokens


def greedy_decode(ex, sid: int, first: Sequence[int], n: int, logits: list | None = None) -> list[int]:
    """Feed the pending token back until n tokens were returned (speculative steps may return more)."""
    toks = list(first)
    while len(toks) < n:
        out = ex.execute([ExecInput(sid, ex.position(sid), tokens=(toks[-1],))])[0]
        assert out.error is None, out.error
        toks.extend(out.tokens)
        if logits is not None:
            logits.append(np.array(out.logits))
    return toks[:n]


class CountingModel:
    """Wraps a model and counts forwards (the executor must pack a batch into one)."""

    def __init__(self, model) -> None:
        self.inner = model
        self.config = model.config
        self.weights_dtype = getattr(model, "weights_dtype", "float32")
        self.calls: list[int] = []

    def embed(self, tokens):
        return self.inner.embed(tokens)

    def __call__(self, step, positions, **kw):
        self.calls.append(int(positions.shape[0]))
        return self.inner(step, positions, **kw)
