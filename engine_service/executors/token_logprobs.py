"""Log probabilities of the drawn tokens, computed on the device beside the draw and read back with it.

For a session whose sampler asks for them (``top_logprobs``), each projected row's log-softmax of the
model's raw float32 logits -- before temperature, top-k / top-p and any grammar mask, as OpenAI
documents its ``logprobs`` -- gives the drawn token's value and the ``k`` largest (ties in index order
as ``mx.argsort`` leaves them). Nothing is computed for the other sessions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine_service.api.logprobs import LogprobEntry, TokenLogprob


@dataclass
class PendingLogprobs:
    """One plan's lazy values: rows ``[at, at + n)``. ``chosen``: float32 [n]; ``top_ids`` int32 [n, k]
    and ``top_values`` float32 [n, k] (most likely first)."""

    plan: Any
    chosen_ids: mx.array
    chosen: mx.array
    top_ids: mx.array
    top_values: mx.array

    def arrays(self) -> list[mx.array]:
        return [self.chosen_ids, self.chosen, self.top_ids, self.top_values]

    def read(self) -> tuple[TokenLogprob, ...]:
        """The values as ``api.logprobs`` records (evaluate :meth:`arrays` first)."""
        ids, chosen = self.chosen_ids.tolist(), self.chosen.tolist()
        top_ids, top_values = self.top_ids.tolist(), self.top_values.tolist()
        return tuple(
            TokenLogprob(
                LogprobEntry(int(t), float(v)),
                tuple(LogprobEntry(int(i), float(x)) for i, x in zip(row_ids, row_values, strict=True)),
            )
            for t, v, row_ids, row_values in zip(ids, chosen, top_ids, top_values, strict=True)
        )


def log_softmax(logits: mx.array) -> mx.array:
    """float [..., vocab] -> float32 [..., vocab]: ``x - logsumexp(x)`` over the last axis."""
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def queue_logprobs(
    logits: mx.array, predicted: mx.array, finishing: Sequence[tuple[Any, int]]
) -> list[PendingLogprobs]:
    """Lazy log probabilities for every finishing plan whose sampler asks for them.

    logits: float [R, vocab] (the projected rows); predicted: int32 [R] (the draws); finishing:
    ``(plan, first row)`` with ``plan.logit_count`` rows each and ``plan.state.sampler``.
    """
    out = []
    for plan, at in finishing:
        sampler = plan.state.sampler
        k = None if sampler is None else sampler.params.top_logprobs
        if k is None:
            continue
        rows = log_softmax(logits[at : at + plan.logit_count])
        ids = predicted[at : at + plan.logit_count]
        chosen = mx.take_along_axis(rows, ids[:, None], axis=-1)[:, 0]
        top_ids = mx.argsort(-rows, axis=-1)[:, :k].astype(mx.int32)
        top_values = mx.take_along_axis(rows, top_ids, axis=-1)
        out.append(PendingLogprobs(plan, ids, chosen, top_ids, top_values))
    return out
