"""ModuleExecutor: raw tokens -> the MLX transformer over a registered KV cache -> sampled tokens, one
forward per round of a batch (:mod:`.rounds`). Spec: docs/ENGINE.md (Executors)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine_service.api.checks import checked_int
from engine_service.api.engine_info import WindowGeometry
from engine_service.api.errors import InvalidArgument
from engine_service.api.limits import EngineLimits, check_fits, check_tokens
from engine_service.api.snapshot_files import StateLayout
from engine_service.cache.batch_control import BatchControl
from engine_service.cache.pinned_state import PinnableCache, PinnedState
from engine_service.cache.seq_state import SeqState, StateTransfer, geometry_text
from engine_service.executors.base import ExecInput, ExecOutput, Executor
from engine_service.executors.cache_setup import (
    build_session_cache,
    cache_config,
    resolve_kv_dtype,
    session_tokens,
)
from engine_service.executors.kv_memory import position_bytes
from engine_service.executors.lookahead import Lookahead
from engine_service.executors.options import DEFAULTS, ExecutorSettings
from engine_service.executors.plan import InputError, Plan, guard
from engine_service.executors.prepared_input import PreparedInput
from engine_service.executors.rounds import Results, Rounds
from engine_service.executors.sampling import Sampler, SamplingParams
from engine_service.executors.session_table import SessionTable


class ModuleExecutor(Executor):
    """Build with :meth:`create`; the constructor takes a built cache."""

    drafts_beside_lookahead = False  # a speculative executor that never drafts on a lookahead step

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
        self._sessions = SessionTable(cache, self.max_sessions)
        enabled = lookahead and lookahead_invisible(self)
        self._lookahead = Lookahead(self.model, cache, self._sessions, self.max_session_tokens, enabled)
        self._rounds = Rounds(
            cache, self._forward, self._lookahead, max_write=self.max_write, keep_logits=keep_logits
        )

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
        kv_memory_mib: int = DEFAULTS.kv_memory_mib,
        **kwargs: Any,
    ) -> ModuleExecutor:
        """The cache for ``model`` (a Transformer or LoadedModel) and the executor over it; ``max_write``
        defaults to ``prefill_chunk``; sessions hold at most the model's context; the cache holds ``max_sessions`` x ``max_session_tokens`` positions
        or what ``kv_memory_mib`` holds (0: auto), the fewer. InvalidArgument for bad limits."""
        prefill_chunk = checked_int("prefill_chunk", prefill_chunk, lo=1)
        max_session_tokens = session_tokens(max_session_tokens, getattr(model, "model", model).config)
        max_write = max_write if max_write is not None else prefill_chunk
        kv_dtype = resolve_kv_dtype(kv_dtype)
        config = cache_config(
            getattr(model, "model", model).config,
            max_sessions=max_sessions,
            max_session_tokens=max_session_tokens,
            kv_dtype=kv_dtype,
            max_write=max_write,
            kv_memory=kv_memory_mib,
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
        return cls.create(
            model,
            settings.cache_kind,
            settings.max_sessions,
            settings.max_session_tokens,
            settings.kv_dtype,
            prefill_chunk=settings.prefill_chunk,
            kv_memory_mib=settings.kv_memory_mib,
            **kwargs,
        )

    def open_session(self) -> int | None:
        self._lookahead.settle()
        return self._sessions.open()

    def close_session(self, sid: int) -> None:
        self._lookahead.settle()
        self._sessions.close(sid)

    def clone(self, sid: int, upto: int) -> int | None:
        self._lookahead.settle()
        return self._sessions.clone(sid, upto)

    def clone_floor(self, sid: int) -> int:
        self._lookahead.settle()
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
        self._lookahead.settle()
        return self._sessions.export(sid, upto)

    def pins_exports(self) -> bool:
        return isinstance(self.cache, PinnableCache)

    def pin_session(self, sid: int) -> PinnedState | None:
        self._lookahead.settle()
        return self._sessions.pin(sid)

    def import_problem(self, state: SeqState) -> str | None:
        if not isinstance(self.cache, StateTransfer):
            return f"the {self.cache_kind} cache does not import sessions"
        try:
            check_fits(0, state.length, self.max_session_tokens, "snapshot")
        except InvalidArgument as exc:
            return str(exc)
        return self.cache.state_problem(state)

    def import_session(self, state: SeqState, history: Sequence[int]) -> int | None:
        self._lookahead.settle()
        return self._sessions.import_state(state, history)

    def set_sampling(self, sid: int, params: SamplingParams, seed: int) -> None:
        self._lookahead.settle()
        self._sessions.state(sid).sampler = Sampler(params, seed)

    def position(self, sid: int) -> int:
        """Committed positions of ``sid`` (inspection: the runner tracks positions itself)."""
        self._lookahead.settle()
        return self.cache.pos(self._sessions.state(sid).seq)

    def limits(self) -> EngineLimits:
        sizes = (self.max_sessions, self.max_session_tokens, self.config.vocab_size, self.cache.capacity)
        return EngineLimits(*sizes, *position_bytes(self.cache.config, self.cache_kind))

    def preferred_batch_tokens(self) -> int:
        return self.prefill_chunk

    @property
    def resident_sessions(self) -> int:
        return len(self._sessions)

    @property
    def lookahead(self) -> bool:
        return self._lookahead.enabled

    @property
    def lookahead_used(self) -> int:
        return self._lookahead.used

    @property
    def lookahead_discarded(self) -> int:
        return self._lookahead.discarded

    @property
    def deterministic(self) -> bool:
        return bool(getattr(self.model, "deterministic", False))

    def fingerprint(self) -> str:
        return executor_fingerprint(self)

    def execute(self, batch: Sequence[ExecInput]) -> list[ExecOutput]:
        ahead = self._lookahead.begin(batch)
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
        if ahead is not None and len(plans) != len(batch):  # an input refused: run the batch afresh
            self._lookahead.discard(ahead)
            ahead = None
        self._settle_drafts(plans)
        results = self._rounds.run(plans, ahead)
        return [entry if isinstance(entry, ExecOutput) else self._output(entry, results) for entry in entries]

    def _output(self, plan: Plan, results: Results) -> ExecOutput:
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
        """Check one input, rewinding its session when it starts below ``committed`` (default: the cache's)."""
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
        if committed is None:
            self._add_drafts(plan)
        else:  # a queued lookahead wrote its one row: no drafts this step
            self._note_drafts(plan)
        guard(check_fits, inp.start, plan.size, self.max_session_tokens)  # room promised to the others
        if inp.start < pos and not self.cache.rewind(state.seq, inp.start):
            raise InputError(
                f"session {inp.sid} cannot rewind from {pos} to {inp.start}: the rows it needs are gone"
            )
        return plan

    def _forward(self, step: Any, positions: mx.array, pieces: list, logit_rows: mx.array) -> mx.array:
        """The model over the packed pieces (raw tokens here; subclasses add embeddings)."""
        tokens: list[int] = []
        for plan, lo, hi in pieces:
            tokens.extend(plan.piece(lo, hi))
        return self.model(step, positions, tokens=mx.array(tokens, dtype=mx.int32), logit_rows=logit_rows)

    def _check_prepared(self, prepared: PreparedInput) -> None:
        """Per-input checks of an accepted prepared input (raise InputError)."""

    def _add_drafts(self, plan: Plan) -> None:
        """Speculative executors extend a decode plan with draft rows here."""

    def _settle_drafts(self, plans: list[Plan]) -> None:
        """With every plan of the batch known: a speculative executor may take drafts back here."""

    def _note_drafts(self, plan: Plan) -> None:
        """A decode plan the lookahead serves: no drafts, but a speculative executor notes whether it
        would have drafted (``SessionState.drafts.active``: the next step runs without a lookahead)."""

    def _finish(self, plan: Plan, preds: list[int]) -> list[int]:
        """Tokens to return for a finished output-producing plan (its last one is the pending token)."""
        return preds


def executor_fingerprint(ex: ModuleExecutor) -> str:
    """Hex sha256 prefix of the model, cache kind, kv dtype, window geometry, weights dtype and mode."""
    model_id = ex._model_fingerprint or hashlib.sha256(repr(ex.config).encode()).hexdigest()
    geometry = ",".join(f"{s.kind}:{s.window}" for s in ex.config.layers)
    parts = [model_id, ex.cache_kind, str(ex.kv_dtype), geometry, f"max_write={ex.max_write}"]
    parts.append(str(ex.weights_dtype))
    if ex.deterministic:  # its snapshots are computed differently: the two never mix
        parts.append("deterministic")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def lookahead_invisible(ex: ModuleExecutor) -> bool:
    """Whether a discarded lookahead leaves no trace: drafts only where the executor keeps them off
    lookahead steps (``drafts_beside_lookahead``). Ring layers take a one-row step back exactly (their
    spare slot: ``CacheConfig.ring_slots``), so sliding windows keep the lookahead too."""
    cls = type(ex)
    plain = cls._add_drafts is ModuleExecutor._add_drafts and cls._finish is ModuleExecutor._finish
    return plain or cls.drafts_beside_lookahead
