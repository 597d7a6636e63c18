"""PromptLookupExecutor: speculative decoding, drafts copied from the session's own history after the
latest match of its last n tokens; a draft is kept while it equals the previous row's draw, the rest
rewound. Greedy: the draw is the argmax. Seeded sampling: each row is drawn with the key plain decoding
uses at that draw (``Sampler.sample_draws``), so the output equals plain seeded decoding token for
token, not just in distribution. Sessions with a grammar or log probabilities decode plainly.
Spec: docs/ENGINE.md."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine_service.api.checks import checked_int
from engine_service.api.errors import InvalidArgument
from engine_service.executors.module import ModuleExecutor
from engine_service.executors.plan import InputError, Plan


class PromptLookupExecutor(ModuleExecutor):
    """ModuleExecutor + prompt-lookup drafts. Extra keywords: ``num_drafts``, ``ngram_max``, ``ngram_min``."""

    def __init__(
        self, *args: Any, num_drafts: int = 6, ngram_max: int = 3, ngram_min: int = 1, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        checked_int("num_drafts", num_drafts, lo=1)
        if num_drafts + 1 > self.max_write:  # a ring layer rewinds rejected drafts only within max_write rows
            raise InvalidArgument(
                f"num_drafts + 1 = {num_drafts + 1} must be <= max_write = {self.max_write}"
            )
        checked_int("ngram_min", ngram_min, lo=1)
        checked_int("ngram_max", ngram_max, lo=ngram_min)
        self.num_drafts = num_drafts
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # draft tokens accepted

    def _add_drafts(self, plan: Plan) -> None:
        if not (plan.want_output and isinstance(plan.rows, tuple) and len(plan.rows) == 1):
            return
        budget = min(self.num_drafts, self.max_session_tokens - plan.start - 1)
        if budget < 1:
            return
        drafts = self.lookup([*plan.state.history[: plan.start], plan.rows[0]], budget)
        if drafts and not self.cache.can_admit(plan.state.seq, 1 + len(drafts)):
            drafts = ()  # no room for the drafts: decode plainly rather than fail the input
        if drafts:
            plan.rows = plan.rows + drafts
            plan.drafts = drafts
            plan.logit_count = 1 + len(drafts)

    def lookup(self, context: list[int], budget: int) -> tuple[int, ...]:
        """Up to ``budget`` tokens that followed the latest earlier match of the context's suffix."""
        arr = np.asarray(context, dtype=np.int64)
        length = arr.shape[0]
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            # windows over arr[:-1] start at i <= length - 1 - n, so arr[i + n] (a continuation) exists
            windows = sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                cont = arr[start : start + budget]
                negative = np.flatnonzero(cont < 0)  # positions from prepared inputs have no token
                if negative.size:
                    cont = cont[: negative[0]]
                if cont.size:
                    return tuple(int(t) for t in cont)
        return ()

    def _finish(self, plan: Plan, preds: list[int]) -> list[int]:
        drafts = plan.drafts
        if not drafts:
            return preds
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == preds[accepted]:
            accepted += 1
        if plan.state.sampler is not None:
            plan.state.sampler.accept_draws(accepted + 1)  # the draws kept: the accepted and the next
        self.drafted += len(drafts)
        self.accepted += accepted
        keep = plan.start + 1 + accepted  # pending + accepted drafts are committed
        if not self.cache.rewind(plan.state.seq, keep):
            raise InputError(f"session {plan.sid}: cannot rewind rejected drafts to {keep}")
        del plan.state.history[keep:]
        return [*drafts[:accepted], preds[accepted]]
