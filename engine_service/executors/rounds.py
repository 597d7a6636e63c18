"""The packed rounds of one batch: each round is one forward over the next <= ``max_write`` positions of
every active plan; its predictions are read back with one ``mx.eval``."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from engine_service.cache.batch_control import BatchControl, Segment
from engine_service.executors.lookahead import Ahead, Lookahead
from engine_service.executors.packed_step import Launched, sample_rows
from engine_service.executors.plan import PREPARED_TOKEN, Plan
from engine_service.executors.token_logprobs import queue_logprobs

# plan index -> (its predictions, the logits behind them when kept)
Results = dict[int, tuple[list[int], mx.array | None]]
# (step, positions int32 [T], pieces, logit rows int32 [R]) -> logits float32 [R, vocab]
Forward = Callable[..., mx.array]


class Rounds:
    """Runs plans to completion over ``cache`` with the executor's ``forward`` (subclasses feed embeddings)."""

    def __init__(
        self,
        cache: BatchControl,
        forward: Forward,
        lookahead: Lookahead,
        *,
        max_write: int,
        keep_logits: bool,
    ) -> None:
        self._cache, self._forward, self._lookahead = cache, forward, lookahead
        self._max_write = max_write
        self._keep_logits = keep_logits

    def run(self, plans: list[Plan], ahead: Ahead | None) -> Results:
        """Write every plan's rows; ``ahead``: a queued step that is the plans' (one row each) first round."""
        results: Results = {}
        if ahead is not None:
            self._finish(self._lookahead.use(ahead, plans), results)
        while True:
            active = [p for p in plans if p.error is None and p.done < p.size]
            if not active:
                return results
            launched = self._launch(active)
            if launched is not None:
                self._finish(launched, results)

    def _launch(self, active: list[Plan]) -> Launched | None:
        """Queue the next packed forward of the active plans (lazy); None when none of them fits."""
        segments, pieces, positions, logit_rows, finishing = [], [], [], [], []
        offset = 0
        for plan in active:
            n = min(plan.size - plan.done, self._max_write)
            begin = plan.start + plan.done
            if not self._cache.can_admit(plan.state.seq, n):
                plan.error = f"no cache room for {n} more positions of session {plan.sid}"
                continue
            segments.append(Segment(plan.state.seq, begin, n))
            pieces.append((plan, plan.done, plan.done + n))
            positions.extend(range(begin, begin + n))
            if plan.want_output and plan.done + n == plan.size:
                finishing.append((plan, len(logit_rows)))
                logit_rows.extend(range(offset + n - plan.logit_count, offset + n))
            offset += n
        if not segments:
            return None
        step = self._cache.begin_step(segments)
        for plan, _, hi in pieces:
            plan.done = hi
        pos = mx.array(positions, dtype=mx.int32)
        if not logit_rows:
            # nothing to predict: run the layers for their K/V only (project one row, never evaluated)
            self._forward(step, pos, pieces, mx.array([0], dtype=mx.int32))
            return Launched(step, pieces, finishing)
        logits = self._forward(step, pos, pieces, mx.array(logit_rows, dtype=mx.int32))
        predicted, keys = sample_rows(logits, finishing)
        extras = queue_logprobs(logits, predicted, finishing)
        return Launched(step, pieces, finishing, predicted, keys, logits, extras)

    def _finish(self, launched: Launched, results: Results) -> None:
        """Record the rows in the histories, queue the next step after a plain decode, then read this one."""
        for plan, lo, hi in launched.pieces:
            chunk = plan.piece(lo, hi)
            tokens = list(chunk) if isinstance(chunk, tuple) else [PREPARED_TOKEN] * (hi - lo)
            at = plan.start + lo
            if at < len(plan.state.history):
                del plan.state.history[at:]
                plan.state.drafts.cut(at)
            plan.state.history.extend(tokens)
        if launched.predicted is None:
            mx.eval(launched.step.state())
            return
        # a grammar's next mask needs this step's token on the host first: no lookahead then
        host = any(p.state.sampler is not None and p.state.sampler.needs_host for p, _ in launched.finishing)
        queued = not host and not self._keep_logits and self._lookahead.launch(launched)
        # No Python name may hold this step's K/V buffers while the next step is queued: its K/V write
        # would find them referenced and copy every buffer instead of writing its rows in place
        # (``CacheConfig.kv_store``). So the arrays to evaluate are gathered only when nothing was queued.
        if not queued:
            to_eval = [*launched.step.state(), launched.predicted, *launched.keys]
            if self._keep_logits:
                to_eval.append(launched.logits)
            for pending in launched.logprobs:
                to_eval.extend(pending.arrays())
            mx.eval(to_eval)
        flat = launched.predicted.tolist()  # waits for this step only; the lookahead keeps running
        for pending in launched.logprobs:
            pending.plan.logprobs = pending.read()
        for plan, at in launched.finishing:
            preds = flat[at : at + plan.logit_count]
            if host and plan.state.sampler is not None and not plan.drafts:  # drafts: the executor's
                plan.state.sampler.observe(preds)
            logits = launched.logits[at : at + plan.logit_count] if self._keep_logits else None
            results[plan.index] = (preds, logits)
