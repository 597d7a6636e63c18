"""One packed forward queued on the device (:class:`Launched`) and the draw of its predictions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine_service.executors.plan import Plan
from engine_service.executors.token_logprobs import PendingLogprobs


@dataclass
class Launched:
    """The cache step it writes, lazy predictions (None: no output) and keys, the pieces ``(plan, lo,
    hi)`` and output rows ``(plan, first logit row)`` it covers."""

    step: Any
    pieces: list[tuple[Plan, int, int]]
    finishing: list[tuple[Plan, int]]
    predicted: mx.array | None = None
    keys: list[mx.array] = field(default_factory=list)
    logits: mx.array | None = None
    logprobs: list[PendingLogprobs] = field(default_factory=list)  # sessions that asked for them


def sample_rows(logits: mx.array, finishing: list[tuple[Plan, int]]) -> tuple[mx.array, list[mx.array]]:
    """int32 [R] predictions for the projected rows and the keys to evaluate: one argmax over the block
    (greedy rows, greedy verification rows); sampled sessions draw their own rows with their own keys
    (verification rows each with the key plain decoding would use there: ``Sampler.sample_draws``)."""
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    sampled = [(plan, at) for plan, at in finishing if plan.state.sampler and plan.state.sampler.per_row]
    sampled = [
        (p, at)
        for p, at in sampled
        if p.logit_count == 1 or not p.state.sampler.greedy or p.state.sampler.masked
    ]
    if not sampled:
        return greedy, []
    parts, keys, cursor = [], [], 0
    for plan, at in sampled:
        if at > cursor:
            parts.append(greedy[cursor:at])
        sampler, count = plan.state.sampler, plan.logit_count
        if count == 1:
            parts.append(sampler.sample(logits[at : at + 1]))
            keys.append(sampler.key)
        else:
            parts.append(sampler.sample_draws(logits[at : at + count], plan.draft_masks))
            keys.extend(sampler.draw_keys)
        cursor = at + count
    if cursor < greedy.shape[0]:
        parts.append(greedy[cursor:])
    return mx.concatenate(parts), keys
