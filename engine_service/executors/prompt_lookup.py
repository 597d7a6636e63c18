"""PromptLookupExecutor: speculative decoding, drafts copied from the session's own history after the
latest match of its last n tokens; a draft is kept while it equals the previous row's draw, the rest
rewound. Greedy: the draw is the argmax. Seeded sampling: each row is drawn with the key plain decoding
uses at that draw (``Sampler.sample_draws``), so the output equals plain seeded decoding token for
token, not just in distribution. A grammar masks each verification row (drafts it forbids are cut
first); log probabilities are the accepted rows'.
Spec: docs/ENGINE.md."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine_service.api.checks import checked_int
from engine_service.api.errors import InvalidArgument
from engine_service.executors.base import ExecInput, ExecOutput
from engine_service.executors.history_grams import HistoryGrams
from engine_service.executors.module import ModuleExecutor
from engine_service.executors.plan import DraftState, InputError, Plan
from engine_service.executors.step_costs import StepCosts
from engine_service.executors.suffix_index import SuffixIndex

RATE_WEIGHT = 0.3  # how much one step moves a session's acceptance rate
PAYS = 0.2  # below this acceptance rate drafting does not pay for its verification rows, even alone
# a forward's fixed cost (reading the weights) over one more row's is ``StepCosts.ratio``, fitted from
# the executor's own steps: beside B decode rows a draft row pays only when accepted at least
# B / (ratio + B)
# what a step that verifies drafts loses, in rows: the decode lookahead (graph building overlapped with
# the last step's compute, ~1.9 ms against ~2 ms a row: bench/profile_decode.py) waits for its tokens
LOST_OVERLAP = 1.0
# the least gain (tokens per unit of cost) drafts must promise: what the model leaves out -- lookups,
# rewinds, a rate that selects its own lucky streaks -- and timing noise eat smaller ones (8 SmolLM2
# sessions at 47-62% acceptance ran at 0.88-0.96x without it)
MIN_GAIN = 1.05
PAYS_WELL = 0.6  # at or above it a session's next pause is short again
PAUSE_STEPS = 32  # steps a session decodes plainly (with the lookahead) once drafting stopped paying
MAX_DOUBLINGS = 4  # a pause grows to 32 x 16 = 512 steps while drafts keep failing
MAX_DRAFT_ROWS = 8  # draft rows per forward, all sessions together (bench/bench_speculative.py)


class PromptLookupExecutor(ModuleExecutor):
    """ModuleExecutor + prompt-lookup drafts. Extra keywords: ``num_drafts``, ``ngram_max``, ``ngram_min``,
    ``suffix`` (also draft from the owner scope's earlier texts: ``suffix_index.py``). Each session
    drafts up to ``num_drafts`` scaled by its acceptance rate and pauses where drafts stop paying."""

    drafts_beside_lookahead = True

    def __init__(
        self,
        *args: Any,
        num_drafts: int = 6,
        ngram_max: int = 3,
        ngram_min: int = 2,
        suffix: bool = False,
        max_draft_rows: int = MAX_DRAFT_ROWS,
        step_costs: StepCosts | None = None,
        **kwargs: Any,
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
        self.sources = {"lookup": [0, 0], "suffix": [0, 0]}  # per draft source: [verified, accepted]
        # draft rows one forward verifies at most, all sessions together (a batch is compute-bound)
        self.max_draft_rows = checked_int("max_draft_rows", max_draft_rows, lo=1)
        self._draft_room = self.max_draft_rows
        self._decoding = 0  # one-token decode inputs in this batch (``execute``)
        self.declined = 0  # draft tokens found but taken back: the batch's drafts would not pay together
        # drafts across requests of the same owner scope (--speculative suffix), fed as sessions close
        self.suffix = SuffixIndex() if suffix else None
        self.step_costs = step_costs or StepCosts()  # fixed / per-row cost of this host's forwards
        self._verifying = 0  # draft rows this batch verifies
        self._last_decode_end: float | None = None  # when the last all-decode batch returned

    def execute(self, batch: Sequence[ExecInput]) -> list[ExecOutput]:
        self._draft_room = self.max_draft_rows  # shared by this batch's sessions, in batch order
        self._decoding = sum(1 for inp in batch if inp.tokens is not None and len(inp.tokens) == 1)
        self._verifying = 0
        outputs = super().execute(batch)
        self._time_step(all_decode=self._decoding == len(batch))
        return outputs

    def _time_step(self, all_decode: bool) -> None:
        """Feed ``step_costs`` the interval since the last batch returned when both were decode-only
        (back to back: the engine thread's whole step; a batch with prefill rows costs differently)."""
        now = time.perf_counter()
        if all_decode and self._last_decode_end is not None:
            self.step_costs.observe(self._decoding + self._verifying, now - self._last_decode_end)
        self._last_decode_end = now if all_decode else None

    @property
    def _pays(self) -> float:
        """The acceptance rate a session's drafts need beside this batch's decode rows."""
        return self._decoding / (self.step_costs.ratio + self._decoding) if self._decoding else 1.0

    def _settle_drafts(self, plans: list[Plan]) -> None:
        """Keep the batch's drafts only where they pay together, ``expected x (ratio + B) > MIN_GAIN x B x
        (LOST_OVERLAP + D)`` (docs/ENGINE.md); else take every draft back (the batch decodes plainly) and
        let each rate learn from its first draft against the token drawn (``_finish``)."""
        drafting = [plan for plan in plans if plan.drafts]
        if not drafting:
            return
        rows = sum(len(plan.drafts) for plan in drafting)
        expected = sum(plan.state.drafts.rate * len(plan.drafts) for plan in drafting)
        if self._pay_together(expected, rows):
            self._verifying = rows
            return
        for plan in drafting:  # their rates learn from the first draft against the token drawn instead
            plan.state.drafts.unverified, plan.state.drafts.active = plan.drafts[0], False
            plan.rows, plan.drafts, plan.logit_count = plan.rows[:1], (), 1
            plan.draft_masks, plan.draft_source = None, ""
        self.declined += rows

    def close_session(self, sid: int) -> None:
        state = self._sessions.get(sid)
        scope = "" if state is None or state.sampler is None else state.sampler.params.scope
        if self.suffix is not None and scope:
            self.suffix.add(scope, state.history)
        super().close_session(sid)

    def _add_drafts(self, plan: Plan) -> None:
        drafts = self._drafts_for(plan)[: self._draft_room]
        if drafts and not self.cache.can_admit(plan.state.seq, 1 + len(drafts)):
            drafts = ()  # no room for the drafts: decode plainly rather than fail the input
        sampler = plan.state.sampler
        if drafts and sampler is not None and sampler.masked:  # only what the grammar allows
            drafts, plan.draft_masks = sampler.draft_masks(drafts, self.config.vocab_size)
        if drafts:
            self._draft_room -= len(drafts)
            plan.rows = plan.rows + drafts
            plan.drafts = drafts
            plan.logit_count = 1 + len(drafts)

    def _note_drafts(self, plan: Plan) -> None:
        """A lookahead step: its lookup's first draft is checked against the token drawn (the rate
        learns without a verification row), and the next step gives the lookahead up (``active``) only
        when drafts like these would pay beside this batch (a transient bigram match on prose does not)."""
        drafts = self._drafts_for(plan)
        if drafts:
            state = plan.state.drafts
            state.unverified = drafts[0]
            state.active = self._pay_together(state.rate * len(drafts), len(drafts))

    def _pay_together(self, expected: float, rows: int) -> bool:
        """Whether ``rows`` draft rows expected to yield ``expected`` tokens pay beside this batch's
        decode rows (``_settle_drafts``)."""
        cost = self._decoding * (LOST_OVERLAP + rows)
        return expected * (self.step_costs.ratio + self._decoding) > MIN_GAIN * cost

    def _drafts_for(self, plan: Plan) -> tuple[int, ...]:
        """The drafts for a one-token decode plan (none while the session's drafting is paused), at most
        the session's budget; notes whether there were any (``DraftState.active``)."""
        state = plan.state.drafts
        state.active = False
        if not (plan.want_output and isinstance(plan.rows, tuple) and len(plan.rows) == 1):
            return ()
        sampler = plan.state.sampler
        if sampler is not None and not sampler.params.drafts:  # GenConfig.speculative "off"
            return ()
        if state.paused:
            state.paused -= 1
            return ()
        if state.rate < self._pays:  # pays alone, not beside this many decode rows: plain this step
            return ()
        budget = min(self.draft_budget(state), self.max_session_tokens - plan.start - 1)
        if budget < 1:
            return ()
        drafts, plan.draft_source = self._drafted(
            plan, budget, "" if sampler is None else sampler.params.scope
        )
        state.active = bool(drafts)
        return drafts

    def _drafted(self, plan: Plan, budget: int, scope: str) -> tuple[tuple[int, ...], str]:
        """(drafts, their source): the session's own history matched on ``ngram_max`` tokens, else the
        scope's earlier texts (``suffix``), else its own history on shorter matches."""
        if self.suffix is None or not scope:
            return self.own_drafts(plan, budget), "lookup"
        drafts = self.own_drafts(plan, budget, self.ngram_max)
        if drafts:
            return drafts, "lookup"
        history, pending = plan.state.history, plan.rows[0]
        drafts = self.suffix.draft(
            scope, [*history[plan.start - self.ngram_max + 1 : plan.start], pending], budget
        )
        if drafts:
            return drafts, "suffix"
        return self.own_drafts(plan, budget), "lookup"

    def own_drafts(self, plan: Plan, budget: int, shortest: int = 0) -> tuple[int, ...]:
        """:meth:`lookup` over the session's history and pending token, from its incremental index."""
        state = plan.state.drafts
        if state.grams is None:
            state.grams = HistoryGrams(self.ngram_min, self.ngram_max)
        return state.grams.find(plan.state.history, plan.start, plan.rows[0], budget, shortest)

    def draft_budget(self, state: DraftState) -> int:
        """Drafts per step: ``num_drafts`` scaled by the session's acceptance rate, at least 1."""
        return max(1, min(self.num_drafts, math.ceil(self.num_drafts * state.rate)))

    def lookup(self, context: list[int], budget: int, shortest: int = 0) -> tuple[int, ...]:
        """Up to ``budget`` tokens that followed the latest earlier match of the context's suffix (of
        ``ngram_max`` down to ``shortest`` tokens; 0: ``ngram_min``)."""
        arr = np.asarray(context, dtype=np.int64)
        length = arr.shape[0]
        for n in range(min(self.ngram_max, length - 1), max(shortest, self.ngram_min) - 1, -1):
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
        drafts, state = plan.drafts, plan.state.drafts
        if not drafts:
            if state.unverified >= 0:  # what the draft not verified would have done
                self._rate(state, float(state.unverified == preds[0]))
                state.unverified = -1
            return preds
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == preds[accepted]:
            accepted += 1
        tokens = [*drafts[:accepted], preds[accepted]]
        if plan.state.sampler is not None:
            plan.state.sampler.accept_draws(accepted + 1)  # the draws kept: the accepted and the next
            plan.state.sampler.observe(tokens)  # a grammar consumes what was kept
        self.drafted += len(drafts)
        self.accepted += accepted
        counts = self.sources[plan.draft_source]
        counts[0], counts[1] = counts[0] + len(drafts), counts[1] + accepted
        self._rate(plan.state.drafts, accepted / len(drafts))
        keep = plan.start + 1 + accepted  # pending + accepted drafts are committed
        if not self.cache.rewind(plan.state.seq, keep):
            raise InputError(f"session {plan.sid}: cannot rewind rejected drafts to {keep}")
        del plan.state.history[keep:]
        plan.state.drafts.cut(keep)
        return tokens

    @staticmethod
    def _rate(state: DraftState, share: float) -> None:
        """Fold one step's accepted share into the session's rate; below ``PAYS`` drafting pauses for
        ``PAUSE_STEPS`` steps, twice as long for each pause in a row (the decode lookahead serves it
        meanwhile), then starts again halfway."""
        state.rate = (1 - RATE_WEIGHT) * state.rate + RATE_WEIGHT * share
        if state.rate >= PAYS_WELL:
            state.pauses = 0
        elif state.rate < PAYS:
            state.paused = PAUSE_STEPS << min(state.pauses, MAX_DOUBLINGS)
            state.pauses, state.rate, state.active = state.pauses + 1, 0.5, False
