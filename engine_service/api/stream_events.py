"""The events of an engine Generate stream, in order: Started, Tokens and Snapshot, then Done (a failed
generation ends with an error instead); enum values are the wire strings."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from engine_service.api.answers import CloneRefusal
from engine_service.api.logprobs import TokenLogprob


class FinishReason(StrEnum):
    """Why a generation ended."""

    STOP = "stop"  # a stop token (returned, and kept by the session as its pending token)
    LENGTH = "length"  # max_new_tokens returned, the session is full, or its owner's quota is
    CANCELLED = "cancelled"  # the caller cancelled (or left), or the engine stopped it
    ERROR = "error"  # it failed (the stream ends with an error)


class SnapshotKind(StrEnum):
    """Why a snapshot was taken where it was; the prefix cache stores it as an entry's ``boundary``."""

    PROMPT = "prompt"  # at the end of the prompt: the whole prompt is reusable
    BREAKPOINT = "breakpoint"  # at a prefill breakpoint inside the prompt: a shared checkpoint
    GENERATED = "generated"  # at the end of the generation: the prompt and the answer's committed tokens


def prompt_snapshot_due(tokens: tuple[int, ...], position: int, prompt_end: int, error: str | None) -> bool:
    """The one prompt-capture rule: on the first update that carries tokens or reaches the prompt's
    end, never on a failed one (its state is not trusted)."""
    return error is None and (bool(tokens) or position >= prompt_end)


@dataclass(frozen=True)
class Started:
    """The generation runs on ``session``, which held ``position`` positions (reused, not
    recomputed); ``input_positions`` will be prefilled."""

    session: str
    position: int
    input_positions: int


@dataclass(frozen=True)
class Tokens:
    """New tokens and the text they add (with ``top_logprobs``: one ``logprobs`` entry per id)."""

    ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """A session holding ``[0, position)`` cloned for the caller, or ``handle`` None with ``reason``
    and ``refusal`` in words."""

    handle: str | None
    position: int
    kind: SnapshotKind
    refusal: str = ""
    content_digest: bytes | None = None
    reason: CloneRefusal | None = None

    def __post_init__(self) -> None:  # wire strings in, enums stored (ValueError for an unknown one)
        object.__setattr__(self, "kind", SnapshotKind(self.kind))
        if self.reason is not None:
            object.__setattr__(self, "reason", CloneRefusal(self.reason))


@dataclass(frozen=True)
class Done:
    """The last event: why the generation finished, what it processed, and its timings."""

    finish_reason: FinishReason
    prompt_positions: int
    reused_positions: int
    generated_tokens: int
    position: int
    time_to_first_token_s: float
    decode_tokens_per_s: float
    total_s: float
    engine: str = ""  # set by the prefix service's gateway: the engine that served (its name there)
    # set by the prefix service: resumes on another engine after a mid-stream failure (fleet/resume.py)
    resumes: int = 0
    resumed_positions: int = 0  # the positions those resumes recomputed
    resume_pause_s: float = 0.0  # the client's pauses, failure to the next event

    def __post_init__(self) -> None:
        object.__setattr__(self, "finish_reason", FinishReason(self.finish_reason))


Event = Started | Tokens | Snapshot | Done
