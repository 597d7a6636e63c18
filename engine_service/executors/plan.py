"""The executor's per-batch bookkeeping: session state, one input's plan (rows it writes, rows projected
to logits, progress through the rounds), per-input failures."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine_service.api.errors import InvalidArgument
from engine_service.api.logprobs import TokenLogprob
from engine_service.executors.history_grams import HistoryGrams
from engine_service.executors.prepared_input import PreparedInput
from engine_service.executors.sampling import Sampler

PREPARED_TOKEN = -1  # history marker for positions that came from a prepared input


class InputError(Exception):
    """One input of a batch is unusable; only its generation fails."""


def guard(rule: Callable[..., object], *args: object) -> None:
    """Apply an ``api.limits`` rule the doors already applied; its refusal fails only this input."""
    try:
        rule(*args)
    except InvalidArgument as exc:
        raise InputError(str(exc)) from None


@dataclass
class SessionState:
    """What the executor keeps per session. ``history[p]`` is the token at committed position p."""

    seq: int
    sampler: Sampler | None = None
    history: list[int] = field(default_factory=list)
    drafts: DraftState = field(default_factory=lambda: DraftState())


@dataclass
class DraftState:
    """A speculative session's drafting: ``active`` (its last lookup found a draft: the decode lookahead
    yields to it), ``rate`` (a moving average of the share of drafts accepted), ``paused`` (steps
    left without drafting after drafts stopped paying; each pause in a row twice the last: ``pauses``)
    and ``unverified`` (a draft found but not verified, checked against the token drawn instead)."""

    active: bool = False
    rate: float = 1.0
    paused: int = 0
    pauses: int = 0
    grams: HistoryGrams | None = None  # the history's n-grams (the drafting executor makes it)
    unverified: int = -1  # the first draft of a lookahead step or a declined batch (-1: none)

    def cut(self, length: int) -> None:
        """The history was cut to ``length`` tokens."""
        if self.grams is not None:
            self.grams.cut(length)


@dataclass
class Plan:
    """One input's work in this batch: ``rows`` raw token ids or a prepared input; its last
    ``logit_count`` rows are projected (drafts add rows); ``done`` positions are written."""

    index: int
    sid: int
    state: SessionState
    start: int
    rows: tuple[int, ...] | PreparedInput
    want_output: bool
    logit_count: int = 1
    drafts: tuple[int, ...] = ()
    draft_source: str = ""  # where the drafts came from (lookup: its own history; suffix: the scope's)
    draft_masks: object = None  # a grammar's masks of the verification rows (mx bool [1 + drafts, vocab])
    done: int = 0
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # read back with the predictions, when asked for

    @property
    def size(self) -> int:
        return len(self.rows) if isinstance(self.rows, tuple) else self.rows.size()

    def piece(self, lo: int, hi: int) -> tuple[int, ...] | PreparedInput:
        return self.rows[lo:hi] if isinstance(self.rows, tuple) else self.rows.chunk(lo, hi)
