"""The decode lookahead: the next decode step queued (``mx.async_eval``) before the last one's tokens are
read back, used only when the next batch feeds those sessions their pending tokens, else taken back.
Spec: docs/MODELS.md (Decode lookahead)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine_service.cache.batch_control import BatchControl, Segment
from engine_service.executors.base import ExecInput
from engine_service.executors.packed_step import Launched, sample_rows
from engine_service.executors.plan import Plan
from engine_service.executors.sampling import Sampler
from engine_service.executors.session_table import SessionTable


@dataclass
class Ahead:
    """A queued step: per session ``(sid, start, seq, written)`` of its row (``written``: the high-water
    mark before it, None without one) and the samplers' keys from before its draws."""

    entries: list[tuple[int, int, int, int | None]]
    launched: Launched
    tokens: mx.array  # the lazy inputs: the previous step's predictions
    saved_keys: list[tuple[Sampler, mx.array]]


class Lookahead:
    """Queues, hands over or discards the step after a plain decode round (``enabled`` only where a
    discard leaves no trace: rings take its row back through their spare slot; no drafting or post-processing)."""

    def __init__(
        self, model: Any, cache: BatchControl, sessions: SessionTable, max_session_tokens: int, enabled: bool
    ) -> None:
        self._model, self._cache, self._sessions = model, cache, sessions
        self._max_session_tokens = max_session_tokens
        self.enabled = enabled
        self.pending: Ahead | None = None
        # steps consumed by the next execute / thrown away (inspection: tests, benchmarks)
        self.used = 0
        self.discarded = 0
        # a step is queued only after a batch that repeated the one before: a runner rotating more
        # decode sessions than one batch takes would otherwise discard every queued step
        self._batch_sids: tuple[int, ...] = ()
        self._repeated = False

    def begin(self, batch: Sequence[ExecInput]) -> Ahead | None:
        """The queued step when ``batch`` continues it, else None (a queued one is discarded)."""
        ahead, self.pending = self.pending, None
        sids = tuple(inp.sid for inp in batch)
        self._repeated, self._batch_sids = sids == self._batch_sids, sids
        if ahead is not None and not self._continues(ahead, batch):
            self.discard(ahead)
            return None
        return ahead

    def use(self, ahead: Ahead, plans: list[Plan]) -> Launched:
        """Hand the queued step to ``plans`` (one per entry, in order) as their finished first round."""
        self.used += 1
        launched = ahead.launched
        launched.pieces = [(plan, 0, 1) for plan in plans]
        launched.finishing = [(plan, i) for i, plan in enumerate(plans)]
        for plan in plans:
            plan.done = 1
        return launched

    def settle(self) -> None:
        """Discard a queued step (before anything that reads or changes sessions or the cache)."""
        ahead, self.pending = self.pending, None
        if ahead is not None:
            self.discard(ahead)

    def launch(self, launched: Launched) -> bool:
        """Queue the step after ``launched`` if it was a plain decode round of a repeated batch."""
        self.pending = self._queue(launched)
        return self.pending is not None

    def _queue(self, launched: Launched) -> Ahead | None:
        if not self.enabled or not launched.finishing or not self._repeated:
            return None
        if len(launched.finishing) != len(launched.pieces):  # one prediction per piece (logit_count 1)
            return None
        cache = self._cache
        entries, segments, positions = [], [], []
        marks = getattr(cache, "sequence", None)  # batched-sequence: per-sequence high-water marks
        for (plan, _, _), (fplan, at) in zip(launched.pieces, launched.finishing, strict=True):
            # a finishing piece ends its plan: size 1 is the whole input, one row
            if fplan is not plan or plan.size != 1 or plan.logit_count != 1 or plan.drafts:
                return None
            if plan.state.drafts.active:  # its next step drafts: a lookahead would be discarded
                return None
            if not isinstance(plan.rows, tuple) or at != len(entries):
                return None
            nxt = plan.start + 1
            if nxt + 1 > self._max_session_tokens or not cache.can_admit(plan.state.seq, 1):
                return None
            written = None if marks is None else marks(plan.state.seq).written
            entries.append((plan.sid, nxt, plan.state.seq, written))
            segments.append(Segment(plan.state.seq, nxt, 1))
            positions.append(nxt)
        saved = [
            (plan.state.sampler, plan.state.sampler.key)
            for plan, _, _ in launched.pieces
            if plan.state.sampler is not None and not plan.state.sampler.greedy
        ]
        tokens = launched.predicted
        step = cache.begin_step(segments)
        logits = self._model(step, mx.array(positions, dtype=mx.int32), tokens=tokens)
        finishing = [(plan, i) for i, (plan, _, _) in enumerate(launched.pieces)]
        predicted, keys = sample_rows(logits, finishing)
        mx.async_eval(
            *launched.step.state(), launched.predicted, *launched.keys, *step.state(), predicted, *keys
        )
        return Ahead(entries, Launched(step, [], [], predicted, keys, logits), tokens, saved)

    def _continues(self, ahead: Ahead, batch: Sequence[ExecInput]) -> bool:
        """Whether ``batch`` feeds exactly the queued step's sessions their predictions at its rows."""
        if len(batch) != len(ahead.entries):
            return False
        for inp, (sid, start, _, _) in zip(batch, ahead.entries, strict=True):
            if (
                inp.sid != sid
                or inp.start != start
                or inp.prepared is not None
                or not inp.want_output
                or inp.tokens is None
                or len(inp.tokens) != 1
                or sid not in self._sessions
            ):
                return False
        expected = ahead.tokens.tolist()
        return all(inp.tokens[0] == tok for inp, tok in zip(batch, expected, strict=True))

    def discard(self, ahead: Ahead) -> None:
        """Undo a queued step: its rows and high-water mark taken back, the samplers' keys put back."""
        self.discarded += 1
        for sampler, key in ahead.saved_keys:
            sampler.restore_key(key)
        for sid, start, seq, written in ahead.entries:
            state = self._sessions.get(sid)
            if state is None or state.seq != seq or self._cache.pos(seq) != start + 1:
                continue
            if written is None:
                self._cache.rewind(seq, start)
            else:
                self._cache.sequence(seq).take_back(start, written)
