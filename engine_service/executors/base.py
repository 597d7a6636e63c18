"""The Executor interface: what the Runner drives to turn inputs into predictions.

Everything here runs on the engine thread. Session ids (``sid``) are executor-local ints.

Commit rule of :meth:`Executor.execute`: each :class:`ExecInput` writes positions
``[start, start + size)`` of its session. ``start`` below the session's position rewinds first
(refusal -> that input fails), equal appends, above is a gap and fails. An input with
``want_output`` returns ``k >= 1`` predicted tokens: the first ``k - 1`` are committed too (accepted
speculative drafts whose K/V is already written), the last is the *pending* prediction, not yet
written. A plain decode step feeds the previous pending token (size 1) and returns 1 token.

A batch that raises poisons the sessions of that batch (the runner fails their generations and
refuses to clone them). A per-input problem is reported in ``ExecOutput.error`` instead and fails only
that input's generation.

Input validation belongs to the runner (``check_input`` in :mod:`engine_service.runtime.scheduler`):
it rejects token ids outside the vocabulary and inputs past ``max_session_tokens`` before anything is
scheduled, with the error the caller sees. An executor does not validate for the caller; it only
guards what would corrupt its own state (see :func:`engine_service.api.limits.out_of_vocab`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from engine_service.api.engine_info import WindowGeometry
from engine_service.api.limits import EngineLimits, check_nonempty
from engine_service.api.logprobs import TokenLogprob
from engine_service.api.snapshot_files import StateLayout
from engine_service.cache.pinned_state import PinnedState
from engine_service.cache.seq_state import SeqState
from engine_service.executors.prepared_input import PreparedInput
from engine_service.executors.sampling import SamplingParams
from engine_service.model.compute_path import ComputePath, describe_compute_path


@dataclass(frozen=True)
class ExecInput:
    """One session's slice of a batch: raw ``tokens`` or a ``prepared`` chunk (exactly one)."""

    sid: int
    start: int
    tokens: tuple[int, ...] | None = None
    prepared: PreparedInput | None = None
    want_output: bool = True

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.prepared is None):
            raise ValueError("ExecInput needs exactly one of tokens / prepared")
        check_nonempty(self.size(), "ExecInput")

    def size(self) -> int:
        return len(self.tokens) if self.tokens is not None else self.prepared.size()


@dataclass(frozen=True)
class ExecOutput:
    """Result for one ExecInput, in batch order.

    tokens: predictions (empty when the input did not want output); all but the last are committed.
    logits: float32 [vocab] logits behind the last prediction, when the executor keeps them (tests).
    error: set when only this input failed (the session is poisoned, others are unaffected).
    logprobs: one entry per token, when the session's sampler asks for them (``top_logprobs``).
    """

    sid: int
    tokens: tuple[int, ...] = ()
    logits: mx.array | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


class Executor(ABC):
    """Turns batches of session inputs into predictions. Default: no clones, no prepared inputs."""

    @abstractmethod
    def open_session(self) -> int | None:
        """A new empty session id, or None when no resident slot is free."""

    @abstractmethod
    def close_session(self, sid: int) -> None:
        """Release the session and everything it holds. Unknown ids are ignored."""

    def clone(self, sid: int, upto: int) -> int | None:
        """A new session holding exactly positions [0, upto) of ``sid``, or None. Never changes ``sid``."""
        return None

    def clone_floor(self, sid: int) -> int:
        """The lowest position a clone of ``sid`` can reach (below it a sliding-window ring no longer
        holds the rows; the runner reports such a refusal as ``CloneRefusal.WINDOW``). Default 0."""
        return 0

    def window_geometry(self) -> WindowGeometry | None:
        """The sliding-window geometry clones obey (None: not described). Read once at start."""
        return None

    @abstractmethod
    def set_sampling(self, sid: int, params: SamplingParams, seed: int) -> None:
        """Sampling for the session's next predictions (reset per generation)."""

    def accepts(self, prepared: PreparedInput) -> bool:
        """Whether this executor can prefill ``prepared`` (metadata only; no work)."""
        return False

    @abstractmethod
    def execute(self, batch: Sequence[ExecInput]) -> list[ExecOutput]:
        """Run one batch; see the module docstring for the commit rule."""

    def preferred_batch_tokens(self) -> int:
        """Packed positions per forward the executor runs best at (prefill chunking hint)."""
        return 512

    @abstractmethod
    def limits(self) -> EngineLimits: ...

    def fingerprint(self) -> str:
        """Identifies model + execution configuration; part of every prefix-cache key."""
        return type(self).__name__

    def compute_path(self) -> ComputePath | None:
        """The compute path the model runs on here (kernels / BLAS / MLX ops, and whether it is slow);
        None when this executor runs no model. Default: described from the executor's ``weights_dtype``
        and ``deterministic`` attributes when it has them (ModuleExecutor)."""
        weights_dtype = getattr(self, "weights_dtype", None)
        if not isinstance(weights_dtype, str):
            return None
        return describe_compute_path(weights_dtype, deterministic=bool(getattr(self, "deterministic", False)))

    # --- snapshots (default: unsupported) ---------------------------------------------------------

    def state_layout(self) -> StateLayout | None:
        """What an exported session's layout depends on (recorded in snapshots, compared on load);
        None when this executor cannot export or import sessions."""
        return None

    def export_session(self, sid: int, upto: int) -> SeqState | None:
        """Positions ``[0, upto)`` of ``sid`` as evaluated arrays, or None (unsupported, or the rows
        they need are gone). Never changes ``sid``."""
        return None

    def pins_exports(self) -> bool:
        """Whether :meth:`pin_session` pins (read once at start; default False)."""
        return False

    def pin_session(self, sid: int) -> PinnedState | None:
        """``sid``'s committed positions pinned for exports on any thread (``cache/pinned_state.py``:
        views of its buffers, no copy), or None where pinning would copy (the default; a cache kind
        that gathers its state, such as ``batched-cell``). Called on an idle session nothing writes
        before its next generation (a clone, an import); never changes ``sid``."""
        return None

    def import_problem(self, state: SeqState) -> str | None:
        """Why ``state`` does not fit this executor's layout (array names, shapes, dtypes, length),
        or None. Checked before :meth:`import_session`; nothing is allocated."""
        return "this executor does not import sessions"

    def import_session(self, state: SeqState, history: Sequence[int]) -> int | None:
        """A new session holding ``state`` (whose positions hold ``history``), or None when no slot or
        room is free. A refusal or an exception leaves nothing allocated."""
        return None
