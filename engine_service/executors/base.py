"""The Executor interface the Runner drives (engine thread only; session ids are executor-local ints).
Spec: docs/ENGINE.md (Executors: the commit rule)."""

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
    """One ExecInput's result, in batch order: ``tokens`` (all but the last committed), ``logits`` float32
    [vocab] behind the last (kept in tests), ``error`` (only this input failed), ``logprobs`` per token."""

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
        """The lowest position a clone of ``sid`` can reach (a ring below it lost the rows). Default 0."""
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
        """Run one batch. Each input writes ``[start, start + size)`` of its session (below the position:
        rewind first; above: a gap, that input fails); an output's tokens but the last are committed."""

    def preferred_batch_tokens(self) -> int:
        """Packed positions per forward the executor runs best at (prefill chunking hint)."""
        return 512

    @abstractmethod
    def limits(self) -> EngineLimits: ...

    def fingerprint(self) -> str:
        """Identifies model + execution configuration; part of every prefix-cache key."""
        return type(self).__name__

    def compute_path(self) -> ComputePath | None:
        """The compute path the model runs on here (None: no model); default from ``weights_dtype``."""
        weights_dtype = getattr(self, "weights_dtype", None)
        if not isinstance(weights_dtype, str):
            return None
        return describe_compute_path(weights_dtype, deterministic=bool(getattr(self, "deterministic", False)))

    # --- snapshots (default: unsupported) ---------------------------------------------------------

    def state_layout(self) -> StateLayout | None:
        """What an exported session's layout depends on (None: no export or import)."""
        return None

    def export_session(self, sid: int, upto: int) -> SeqState | None:
        """Positions ``[0, upto)`` of ``sid`` as evaluated arrays, or None. Never changes ``sid``."""
        return None

    def pins_exports(self) -> bool:
        """Whether :meth:`pin_session` pins (read once at start; default False)."""
        return False

    def pin_session(self, sid: int) -> PinnedState | None:
        """``sid``'s committed positions pinned for exports on any thread (views, no copy), or None where
        pinning would copy. Called on an idle session; never changes ``sid``."""
        return None

    def import_problem(self, state: SeqState) -> str | None:
        """Why ``state`` does not fit this executor's layout, or None (nothing is allocated)."""
        return "this executor does not import sessions"

    def import_session(self, state: SeqState, history: Sequence[int]) -> int | None:
        """A new session holding ``state`` (whose positions hold ``history``), or None; a refusal or an
        exception leaves nothing allocated."""
        return None
