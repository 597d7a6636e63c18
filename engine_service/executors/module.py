"""ModuleExecutor: raw tokens -> the MLX transformer over a registered KV cache -> sampled tokens.

One :meth:`ModuleExecutor.execute` call packs every input of the batch into one forward (segments in
batch order, each row at its own position) and projects only the rows whose prediction is needed
(the last row of each output-producing input). An input longer than the cache's ``max_write`` is
split into rounds of at most ``max_write`` positions per session; each round is one forward. Per
forward it evaluates exactly the cache state arrays of the step, the sampled tokens and the advanced
PRNG keys (plus the kept logits in tests), in one ``mx.eval``.

Sessions are executor-local ids mapped to cache sequences. ``max_sessions`` bounds every resident
session (active, retained snapshots, in-flight clones); each contributes ``max_session_tokens`` to
the cache's logical capacity, which is checked at creation, not a byte budget.

Checks per input, and who owns them: the runner validates every generation's input (vocabulary,
``max_session_tokens``, accepted prepared kinds) before it schedules anything, so in the engine these
never fire. The executor keeps only the guards that protect its own state when it is driven directly
(tests, benchmarks): a token id outside the vocabulary would index the embedding table out of bounds
(MLX gathers do not check), and a session past ``max_session_tokens`` would take cache room promised
to the other resident sessions. Both are cheap and fail only that input (``ExecOutput.error``). The
gap / rewind / duplicate-session rules are the commit rule itself, not validation.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine_service.api.checks import checked_int
from engine_service.api.engine_info import WindowGeometry
from engine_service.api.errors import NotFound
from engine_service.api.limits import EngineLimits, check_fits, check_tokens
from engine_service.api.snapshot_files import StateLayout
from engine_service.cache.batch_control import BatchControl, Segment
from engine_service.cache.pinned_state import PinnableCache, PinnedState
from engine_service.cache.seq_state import SeqState, StateTransfer, geometry_text
from engine_service.executors.base import ExecInput, ExecOutput, Executor
from engine_service.executors.cache_setup import build_session_cache, cache_config, resolve_kv_dtype
from engine_service.executors.lookahead import LookaheadMixin, _Launched, _Lookahead
from engine_service.executors.options import DEFAULTS, ExecutorSettings
from engine_service.executors.plan import PREPARED_TOKEN, InputError, Plan, SessionState, guard
from engine_service.executors.prepared_input import PreparedInput
from engine_service.executors.sampling import Sampler, SamplingParams
from engine_service.executors.token_logprobs import queue_logprobs

log = logging.getLogger(__name__)


class ModuleExecutor(LookaheadMixin, Executor):
    """See the module docstring. Build with :meth:`create`; the constructor takes a built cache."""

    def __init__(
        self,
        model: Any,
        cache: BatchControl,
        *,
        cache_kind: str,
        max_sessions: int,
        max_session_tokens: int,
        kv_dtype: mx.Dtype | None = None,
        max_write: int = DEFAULTS.prefill_chunk,
        prefill_chunk: int = DEFAULTS.prefill_chunk,
        keep_logits: bool = False,
        weights_dtype: str | None = None,
        model_fingerprint: str | None = None,
        deterministic: bool = False,
        lookahead: bool = True,
    ) -> None:
        # a LoadedModel carries the Transformer plus its identity
        self.model = getattr(model, "model", model)
        if deterministic:  # FailedPrecondition when the kernels or block weights are missing
            from engine_service.model import deterministic as det

            det.enable(self.model)
        self.config = self.model.config
        self.cache = cache
        self.cache_kind = cache_kind
        self.max_sessions = checked_int("max_sessions", max_sessions, lo=1)
        self.max_session_tokens = checked_int("max_session_tokens", max_session_tokens, lo=1)
        self.max_write = checked_int("max_write", max_write, lo=1)
        self.prefill_chunk = checked_int("prefill_chunk", prefill_chunk, lo=1)
        self.kv_dtype = cache.config.dtype if kv_dtype is None else kv_dtype
        self.keep_logits = keep_logits
        self.weights_dtype = (
            weights_dtype
            or getattr(model, "weights_dtype", None)
            or getattr(self.model, "weights_dtype", "unknown")
        )
        self._model_fingerprint = model_fingerprint or getattr(model, "fingerprint", None)
        self._sessions: dict[int, SessionState] = {}
        self._next_sid = 1
        self._ahead: _Lookahead | None = None
        self.lookahead = lookahead and self._lookahead_invisible()
        # lookahead steps consumed by the next execute / thrown away (inspection: tests, benchmarks)
        self.lookahead_used = 0
        self.lookahead_discarded = 0
        # the sessions of the last two batches, in order: a lookahead is queued only after a batch
        # that repeated the one before (a runner rotating more decode sessions than one batch takes
        # would otherwise have every queued step discarded: a wasted forward each round)
        self._batch_sids: tuple[int, ...] = ()
        self._batch_repeated = False

    @classmethod
    def create(
        cls,
        model: Any,
        cache_kind: str = DEFAULTS.cache_kind,
        max_sessions: int = DEFAULTS.max_sessions,
        max_session_tokens: int = DEFAULTS.max_session_tokens,
        kv_dtype: str | mx.Dtype = DEFAULTS.kv_dtype,
        *,
        prefill_chunk: int = DEFAULTS.prefill_chunk,
        keep_logits: bool = False,
        weights_dtype: str | None = None,
        max_write: int | None = None,
        model_fingerprint: str | None = None,
        **kwargs: Any,
    ) -> ModuleExecutor:
        """Build the cache for ``model`` and check the resident-session and capacity limits.

        model: a Transformer or a LoadedModel (its fingerprint and weights dtype are used).
        max_write: positions one forward may write per session (ring layers keep ``window + max_write
        - 1`` slots); default ``prefill_chunk``. Raises InvalidArgument for malformed limits and
        ResourceExhausted when the backend cannot hold ``max_sessions`` sessions of
        ``max_session_tokens`` each (see :mod:`.cache_setup`). ``kv_dtype``: the K/V storage dtype
        (``auto``: :func:`.cache_setup.resolve_kv_dtype`). ``kwargs`` go to the subclass
        constructor. How many decode steps share a forward is the Runner's setting
        (``max_decode_sequences``): any number of inputs runs as one forward here.
        """
        prefill_chunk = checked_int("prefill_chunk", prefill_chunk, lo=1)
        max_write = max_write if max_write is not None else prefill_chunk
        kv_dtype = resolve_kv_dtype(kv_dtype)
        config = cache_config(
            getattr(model, "model", model).config,
            max_sessions=max_sessions,
            max_session_tokens=max_session_tokens,
            kv_dtype=kv_dtype,
            max_write=max_write,
        )
        cache = build_session_cache(cache_kind, config)
        return cls(
            model,
            cache,
            cache_kind=cache_kind,
            max_sessions=max_sessions,
            max_session_tokens=max_session_tokens,
            kv_dtype=kv_dtype,
            max_write=max_write,
            prefill_chunk=prefill_chunk,
            keep_logits=keep_logits,
            weights_dtype=weights_dtype,
            model_fingerprint=model_fingerprint,
            **kwargs,
        )

    @classmethod
    def from_settings(cls, model: Any, settings: ExecutorSettings, **kwargs: Any) -> ModuleExecutor:
        """:meth:`create` with the executor settings of ``settings`` (the engine's flags)."""
        return cls.create(
            model,
            settings.cache_kind,
            settings.max_sessions,
            settings.max_session_tokens,
            settings.kv_dtype,
            prefill_chunk=settings.prefill_chunk,
            **kwargs,
        )

    # --- sessions -------------------------------------------------------------------------------

    def open_session(self) -> int | None:
        self._settle()
        if len(self._sessions) >= self.max_sessions:
            return None
        seq = self.cache.seq_new()
        return None if seq is None else self._register(SessionState(seq))

    def close_session(self, sid: int) -> None:
        self._settle()
        state = self._sessions.pop(sid, None)
        if state is not None:
            self.cache.seq_rm(state.seq)

    def clone(self, sid: int, upto: int) -> int | None:
        """Clone via the cache, then re-check the position the backend reports; undo a mismatch."""
        self._settle()
        state = self._sessions.get(sid)
        if state is None or upto < 0 or len(self._sessions) >= self.max_sessions:
            return None
        child = None
        try:
            child = self.cache.seq_clone(state.seq, upto)
            if child is None:
                return None
            got = self.cache.pos(child)
            if got != upto:
                log.warning("clone(%d, %d): backend reports position %d; undoing", sid, upto, got)
                self.cache.seq_rm(child)
                return None
        except Exception:  # the contract: any failure inside clone is a refusal, the engine keeps running
            log.exception("clone(%d, %d) failed; refusing", sid, upto)
            if child is not None:
                try:
                    self.cache.seq_rm(child)
                except Exception:
                    log.exception("releasing the failed clone's sequence %d failed", child)
            return None
        return self._register(SessionState(child, history=state.history[:upto]))

    def clone_floor(self, sid: int) -> int:
        """The session's ring floor (``written - max_write`` on ``batched-sequence`` with sliding
        layers; 0 on a cache that keeps every row)."""
        self._settle()
        state = self._sessions.get(sid)
        floor = getattr(self.cache, "rewind_floor", None)
        return 0 if state is None or floor is None else int(floor(state.seq))

    def window_geometry(self) -> WindowGeometry:
        windows = [spec.window for spec in self.config.layers if spec.sliding and spec.window]
        return WindowGeometry(
            max(windows, default=0), self.max_write, bool(windows) and hasattr(self.cache, "rewind_floor")
        )

    def state_layout(self) -> StateLayout | None:
        if not isinstance(self.cache, StateTransfer):
            return None
        return StateLayout(self.cache_kind, geometry_text(self.cache.config))

    def export_session(self, sid: int, upto: int) -> SeqState | None:
        self._settle()
        state = self._sessions.get(sid)
        if state is None or upto < 0 or not isinstance(self.cache, StateTransfer):
            return None
        return self.cache.export_seq(state.seq, upto)

    def pins_exports(self) -> bool:
        return isinstance(self.cache, PinnableCache)

    def pin_session(self, sid: int) -> PinnedState | None:
        self._settle()
        state = self._sessions.get(sid)
        if state is None or not isinstance(self.cache, PinnableCache):
            return None
        return self.cache.pin_seq(state.seq)

    def import_problem(self, state: SeqState) -> str | None:
        if not isinstance(self.cache, StateTransfer):
            return f"the {self.cache_kind} cache does not import sessions"
        if state.length > self.max_session_tokens:
            return f"{state.length} positions exceed max_session_tokens={self.max_session_tokens}"
        return self.cache.state_problem(state)

    def import_session(self, state: SeqState, history: Sequence[int]) -> int | None:
        self._settle()
        if len(self._sessions) >= self.max_sessions or len(history) != state.length:
            return None
        seq = self.cache.import_seq(state)
        return None if seq is None else self._register(SessionState(seq, history=list(history)))

    def set_sampling(self, sid: int, params: SamplingParams, seed: int) -> None:
        self._settle()
        self._state(sid).sampler = Sampler(params, seed)

    def position(self, sid: int) -> int:
        """Committed positions of ``sid`` as the cache reports them (inspection; not in the interface:
        the runner tracks positions itself)."""
        self._settle()
        return self.cache.pos(self._state(sid).seq)

    def limits(self) -> EngineLimits:
        return EngineLimits(self.max_sessions, self.max_session_tokens, self.config.vocab_size)

    def preferred_batch_tokens(self) -> int:
        return self.prefill_chunk

    @property
    def resident_sessions(self) -> int:
        return len(self._sessions)

    @property
    def deterministic(self) -> bool:
        """Whether the model runs batch-invariant (see :mod:`engine_service.model.deterministic`)."""
        return bool(getattr(self.model, "deterministic", False))

    def fingerprint(self) -> str:
        """Model identity + cache kind + kv dtype + window geometry + weights dtype (+ deterministic mode:
        its snapshots are computed differently, so the two never mix) (hex sha256 prefix)."""
        model_id = self._model_fingerprint or hashlib.sha256(repr(self.config).encode()).hexdigest()
        geometry = ",".join(f"{s.kind}:{s.window}" for s in self.config.layers)
        parts = [
            model_id,
            self.cache_kind,
            str(self.kv_dtype),
            geometry,
            f"max_write={self.max_write}",
            str(self.weights_dtype),
        ]
        if self.deterministic:
            parts.append("deterministic")
        text = "|".join(parts)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    # --- execution ------------------------------------------------------------------------------

    def execute(self, batch: Sequence[ExecInput]) -> list[ExecOutput]:
        ahead, self._ahead = self._ahead, None
        sids = tuple(inp.sid for inp in batch)
        self._batch_repeated, self._batch_sids = sids == self._batch_sids, sids
        if ahead is not None and not self._continues(ahead, batch):
            self._discard(ahead)
            ahead = None
        # one entry per input, in batch order: its plan, or the output of an input refused up front
        entries: list[Plan | ExecOutput] = []
        seen: set[int] = set()
        for index, inp in enumerate(batch):
            try:
                # a queued lookahead already wrote this input's row: the committed position is its start
                entries.append(self._plan(index, inp, seen, inp.start if ahead is not None else None))
            except InputError as exc:
                entries.append(ExecOutput(inp.sid, error=str(exc)))
            seen.add(inp.sid)
        plans = [entry for entry in entries if isinstance(entry, Plan)]
        results: dict[int, tuple[list[int], mx.array | None]] = {}
        if ahead is not None and len(plans) != len(batch):  # an input refused: run the batch afresh
            self._discard(ahead)
            ahead = None
        if ahead is not None:  # _continues checked that every input is the lookahead's
            self.lookahead_used += 1
            launched = ahead.launched
            launched.pieces = [(plan, 0, 1) for plan in plans]
            launched.finishing = [(plan, i) for i, plan in enumerate(plans)]
            for plan in plans:
                plan.done = 1
            self._finish_round(launched, results)
        while True:
            active = [p for p in plans if p.error is None and p.done < p.size]
            if not active:
                break
            self._round(active, results)
        return [entry if isinstance(entry, ExecOutput) else self._output(entry, results) for entry in entries]

    def _output(self, plan: Plan, results: dict[int, tuple[list[int], mx.array | None]]) -> ExecOutput:
        if plan.error is not None:
            return ExecOutput(plan.sid, error=plan.error)
        if plan.index not in results:  # no output wanted
            return ExecOutput(plan.sid)
        preds, logits = results[plan.index]
        try:
            tokens = self._finish(plan, preds)
        except InputError as exc:
            return ExecOutput(plan.sid, error=str(exc))
        # the logits behind the last returned token (the pending prediction)
        kept = None if logits is None else logits[len(tokens) - 1]
        return ExecOutput(plan.sid, tuple(tokens), logits=kept, logprobs=plan.logprobs[: len(tokens)] or None)

    def _plan(self, index: int, inp: ExecInput, seen: set[int], committed: int | None = None) -> Plan:
        """Validate one input and rewind its session when it starts below the current position
        (``committed``: that position when the cache's length is past it by a queued lookahead)."""
        state = self._sessions.get(inp.sid)
        if state is None:
            raise InputError(f"unknown session {inp.sid}")
        if inp.sid in seen:
            raise InputError(f"session {inp.sid} appears twice in one batch")
        if inp.prepared is not None:
            if not self.accepts(inp.prepared):
                raise InputError(
                    f"{type(self).__name__} does not accept prepared inputs of kind {inp.prepared.kind()!r}"
                )
            self._check_prepared(inp.prepared)
            rows: tuple[int, ...] | PreparedInput = inp.prepared
        else:
            rows = tuple(inp.tokens)
            guard(check_tokens, rows, self.config.vocab_size)  # MLX gathers do not bounds-check
        pos = self.cache.pos(state.seq) if committed is None else committed
        if inp.start > pos:
            raise InputError(f"input starts at {inp.start} but session {inp.sid} is at {pos} (gap)")
        plan = Plan(index, inp.sid, state, inp.start, rows, inp.want_output)
        if state.sampler is None or not state.sampler.needs_host:  # a mask or logprobs: no drafts
            self._add_drafts(plan)
        guard(check_fits, inp.start, plan.size, self.max_session_tokens)  # room promised to the others
        if inp.start < pos and not self.cache.rewind(state.seq, inp.start):
            raise InputError(
                f"session {inp.sid} cannot rewind from {pos} to {inp.start}: the rows it needs are gone"
            )
        return plan

    def _round(self, active: list[Plan], results: dict[int, tuple[list[int], mx.array | None]]) -> None:
        """One packed forward over the next <= max_write positions of every active plan."""
        launched = self._launch(active)
        if launched is not None:
            self._finish_round(launched, results)

    def _launch(self, active: list[Plan]) -> _Launched | None:
        """Queue the next packed forward of the active plans (lazy); None when none of them fits."""
        segments, pieces, positions, logit_rows, finishing = [], [], [], [], []
        offset = 0
        for plan in active:
            n = min(plan.size - plan.done, self.max_write)
            begin = plan.start + plan.done
            if not self.cache.can_admit(plan.state.seq, n):
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
        step = self.cache.begin_step(segments)
        for plan, _, hi in pieces:
            plan.done = hi
        pos = mx.array(positions, dtype=mx.int32)
        if not logit_rows:
            # nothing to predict: run the layers for their K/V only (project one row, never evaluated)
            self._forward(step, pos, pieces, mx.array([0], dtype=mx.int32))
            return _Launched(step, pieces, finishing)
        logits = self._forward(step, pos, pieces, mx.array(logit_rows, dtype=mx.int32))
        predicted, keys = self._sample(logits, finishing)
        extras = queue_logprobs(logits, predicted, finishing)
        return _Launched(step, pieces, finishing, predicted, keys, logits, extras)

    def _finish_round(
        self, launched: _Launched, results: dict[int, tuple[list[int], mx.array | None]]
    ) -> None:
        """Record the round's rows in the sessions' histories, queue the next decode step when this one
        is a plain decode (:meth:`_launch_ahead`), then evaluate this one and read its predictions."""
        for plan, lo, hi in launched.pieces:
            chunk = plan.piece(lo, hi)
            tokens = list(chunk) if isinstance(chunk, tuple) else [PREPARED_TOKEN] * (hi - lo)
            at = plan.start + lo
            del plan.state.history[at:]
            plan.state.history.extend(tokens)
        if launched.predicted is None:
            mx.eval(launched.step.state())
            return
        # a grammar's next mask needs this step's token on the host first: no lookahead then
        host = any(p.state.sampler is not None and p.state.sampler.needs_host for p, _ in launched.finishing)
        # No Python name may hold this step's K/V buffers while the next step is queued: its K/V write
        # would find them referenced and copy every buffer instead of writing its rows in place
        # (``CacheConfig.kv_store``). So the arrays to evaluate are gathered only when nothing was queued.
        self._ahead = None if host else self._launch_ahead(launched)
        if self._ahead is None:
            to_eval = [*launched.step.state(), launched.predicted, *launched.keys]
            if self.keep_logits:
                to_eval.append(launched.logits)
            for pending in launched.logprobs:
                to_eval.extend(pending.arrays())
            mx.eval(to_eval)
        flat = launched.predicted.tolist()  # waits for this step only; the lookahead keeps running
        for pending in launched.logprobs:
            pending.plan.logprobs = pending.read()
        for plan, at in launched.finishing:
            preds = flat[at : at + plan.logit_count]
            if host and plan.state.sampler is not None:
                plan.state.sampler.observe(preds)
            logits = launched.logits[at : at + plan.logit_count] if self.keep_logits else None
            results[plan.index] = (preds, logits)

    def _lookahead_invisible(self) -> bool:
        """Whether a discarded lookahead leaves no trace (see :mod:`.lookahead`): no drafting or
        post-processing subclass, no ring layers that evict rows."""
        cls = type(self)
        plain = cls._add_drafts is ModuleExecutor._add_drafts and cls._finish is ModuleExecutor._finish
        rings = hasattr(self.cache, "rewind_floor") and any(
            spec.sliding and spec.window for spec in self.config.layers
        )
        return plain and not rings

    def _forward(self, step: Any, positions: mx.array, pieces: list, logit_rows: mx.array) -> mx.array:
        """Run the model over the packed pieces. Raw tokens only here; subclasses add embeddings."""
        tokens: list[int] = []
        for plan, lo, hi in pieces:
            tokens.extend(plan.piece(lo, hi))
        return self.model(step, positions, tokens=mx.array(tokens, dtype=mx.int32), logit_rows=logit_rows)

    def _sample(self, logits: mx.array, finishing: list[tuple[Plan, int]]) -> tuple[mx.array, list[mx.array]]:
        """Predictions for every projected row, on the device: int32 [R], plus keys to evaluate.

        Greedy rows (and speculative verification rows) take the argmax of the whole block at once;
        sampled sessions draw from their own row with their own key.
        """
        greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
        sampled = [
            (plan, at)
            for plan, at in finishing
            if plan.state.sampler and plan.state.sampler.per_row and plan.logit_count == 1
        ]
        if not sampled:
            return greedy, []
        parts, keys, cursor = [], [], 0
        for plan, at in sampled:
            if at > cursor:
                parts.append(greedy[cursor:at])
            parts.append(plan.state.sampler.sample(logits[at : at + 1]))
            keys.append(plan.state.sampler.key)
            cursor = at + 1
        if cursor < greedy.shape[0]:
            parts.append(greedy[cursor:])
        return mx.concatenate(parts), keys

    # --- hooks for subclasses -------------------------------------------------------------------

    def _check_prepared(self, prepared: PreparedInput) -> None:
        """Per-input checks of an accepted prepared input (raise InputError)."""

    def _add_drafts(self, plan: Plan) -> None:
        """Speculative executors extend a decode plan with draft rows here."""

    def _finish(self, plan: Plan, preds: list[int]) -> list[int]:
        """Tokens to return for a finished output-producing plan (its last one is the pending token)."""
        return preds

    # --- helpers --------------------------------------------------------------------------------

    def _register(self, state: SessionState) -> int:
        sid = self._next_sid
        self._next_sid += 1
        self._sessions[sid] = state
        return sid

    def _state(self, sid: int) -> SessionState:
        state = self._sessions.get(sid)
        if state is None:
            raise NotFound(f"unknown session {sid}")
        return state
