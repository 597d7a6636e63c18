"""Log probabilities of the drawn tokens, on the device beside the draw: the log-softmax of the raw
float32 logits (before temperature, filters and masks, as OpenAI documents ``logprobs``), only for
sessions that ask (``top_logprobs``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine_service.api.logprobs import LogprobEntry, TokenLogprob


@dataclass
class PendingLogprobs:
    """One plan's lazy values: ``chosen`` float32 [n]; ``top_ids`` int32 / ``top_values`` float32 [n, k]."""

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
    """Lazy log probabilities for the finishing plans that ask: logits float [R, vocab], predicted
    int32 [R], finishing ``(plan, first row)``."""
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
