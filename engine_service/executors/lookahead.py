"""The decode lookahead of :class:`~engine_service.executors.module.ModuleExecutor`: the next decode
step queued before the last one's tokens are read back.

A decode step's inputs are the previous step's predictions, which stay on the device until read.
So the step after a plain decode round (every session one raw token, one prediction, no drafts)
is built and queued (mx.async_eval) before the round's tokens are read back: the graph of step
n + 1 and the runner's work between steps overlap step n's compute. It writes each session's
next row past the committed position, which no caller sees: the next ``execute`` uses it only
when it feeds exactly those sessions their pending tokens at those positions, and anything else
-- another batch, a clone, a close, an export, a new sampler, a position query -- first discards
it (a rewind of that row, the samplers' keys put back). Queued only when this batch has the
sessions of the one before, so a runner rotating sessions through batches wastes no forwards.
Only where a rewind restores everything:
not on a cache whose ring layers evict rows (``batched-sequence`` with sliding windows, where the
extra row would move the clone floor) and not in subclasses that draft or post-process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine_service.cache.batch_control import Segment
from engine_service.executors.base import ExecInput
from engine_service.executors.plan import Plan
from engine_service.executors.sampling import Sampler
from engine_service.executors.token_logprobs import PendingLogprobs


@dataclass
class _Launched:
    """One packed forward queued on the device: the cache step it writes, its lazy predictions (None:
    no output wanted) and PRNG keys, and which plan pieces / output rows it covers."""

    step: Any
    pieces: list[tuple[Plan, int, int]]
    finishing: list[tuple[Plan, int]]
    predicted: mx.array | None = None
    keys: list[mx.array] = field(default_factory=list)
    logits: mx.array | None = None
    logprobs: list[PendingLogprobs] = field(default_factory=list)  # sessions that asked for them


@dataclass
class _Lookahead:
    """The decode step after the last one, queued before that one's tokens were read back (see
    :meth:`LookaheadMixin._launch_ahead`): for each session in batch order ``(sid, start, seq, written)``
    of the row it wrote (``written``: the sequence's high-water mark before it, None on a cache without
    per-sequence marks), and the samplers' keys from before its draws."""

    entries: list[tuple[int, int, int, int | None]]
    launched: _Launched
    tokens: mx.array  # the lazy inputs: the previous step's predictions
    saved_keys: list[tuple[Sampler, mx.array]]


class LookaheadMixin:
    """The lookahead's methods of :class:`~engine_service.executors.module.ModuleExecutor`, which
    provides what they use: ``lookahead``, ``keep_logits``, ``_batch_repeated``, ``_ahead``,
    ``lookahead_discarded``, ``cache``, ``model``, ``max_session_tokens``, ``_sessions`` and
    ``_sample``."""

    def _launch_ahead(self, launched: _Launched) -> _Lookahead | None:
        if not self.lookahead or self.keep_logits or not launched.finishing or not self._batch_repeated:
            return None
        if len(launched.finishing) != len(launched.pieces):  # one prediction per piece (logit_count 1)
            return None
        entries, segments, positions = [], [], []
        marks = getattr(self.cache, "sequence", None)  # batched-sequence: per-sequence high-water marks
        for (plan, _, _), (fplan, at) in zip(launched.pieces, launched.finishing, strict=True):
            # a finishing piece ends its plan: size 1 is the whole input, one row
            if fplan is not plan or plan.size != 1 or plan.logit_count != 1 or plan.drafts:
                return None
            if not isinstance(plan.rows, tuple) or at != len(entries):
                return None
            nxt = plan.start + 1
            if nxt + 1 > self.max_session_tokens or not self.cache.can_admit(plan.state.seq, 1):
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
        step = self.cache.begin_step(segments)
        logits = self.model(step, mx.array(positions, dtype=mx.int32), tokens=tokens)
        finishing = [(plan, i) for i, (plan, _, _) in enumerate(launched.pieces)]
        predicted, keys = self._sample(logits, finishing)
        mx.async_eval(
            *launched.step.state(), launched.predicted, *launched.keys, *step.state(), predicted, *keys
        )
        return _Lookahead(entries, _Launched(step, [], [], predicted, keys, logits), tokens, saved)

    def _continues(self, ahead: _Lookahead, batch: Sequence[ExecInput]) -> bool:
        """Whether ``batch`` feeds exactly the lookahead's sessions their predictions at its rows."""
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

    def _discard(self, ahead: _Lookahead) -> None:
        """Undo a lookahead nobody uses: its rows taken back (the high-water mark too, so an export
        or a clone sees no trace of it), the samplers' keys put back."""
        self.lookahead_discarded += 1
        for sampler, key in ahead.saved_keys:
            sampler.restore_key(key)
        for sid, start, seq, written in ahead.entries:
            state = self._sessions.get(sid)
            if state is None or state.seq != seq or self.cache.pos(seq) != start + 1:
                continue
            if written is None:
                self.cache.rewind(seq, start)
            else:
                self.cache.sequence(seq).take_back(start, written)

    def _settle(self) -> None:
        """Discard a queued lookahead (before anything that reads or changes sessions or the cache)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._discard(ahead)
