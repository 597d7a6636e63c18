"""Engine-side state of a session and of the generation running on it. Only the engine thread writes
it (``busy`` aside: set under the session lock); others read single attributes or copy ``content``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_service.api.config import GenConfig
from engine_service.api.stream_events import FinishReason
from engine_service.executors.prepared_input import PreparedInput
from engine_service.runtime.content_log import ContentLog
from engine_service.runtime.generation import (
    GenerationHandle,
    GenerationMetrics,
    GenerationResult,
    GenerationUpdate,
)

if TYPE_CHECKING:
    from engine_service.runtime.snapshots import PinnedSnapshot

Segment = tuple[int, ...] | PreparedInput


@dataclass(eq=False)
class SessionRecord:
    """One executor session as the runner sees it."""

    key: int
    sid: int
    # accepted positions: a speculative executor may have written more; only this authorizes a clone
    position: int = 0
    pending: int | None = None  # the last prediction, not written yet; fed first by the next generation
    content: ContentLog = field(default_factory=ContentLog)  # [0, position): ids, PREPARED for prepared
    poisoned: bool = False
    closed: bool = False
    busy: bool = False
    generation: ActiveGeneration | None = None
    # set by the engine thread on a new clone or import, dropped when a generation starts or it
    # closes; read by any thread (one attribute read): its export without the engine thread
    pinned: PinnedSnapshot | None = None


@dataclass(eq=False)
class ActiveGeneration:
    """A generation from its start command to its terminal update."""

    handle: GenerationHandle
    config: GenConfig
    callback: Callable[[GenerationUpdate], None] | None
    input: Segment
    record: SessionRecord | None = None
    # what prefill still feeds: the pending token (a 1-tuple) when continuing, then the input; chunks
    # never cross a segment boundary; ``offset`` indexes segments[0]
    segments: list[Segment] = field(default_factory=list)
    offset: int = 0
    input_fed: int = 0  # of the caller's input (the replayed pending token excluded)
    tokens: list[int] = field(default_factory=list)
    cancel_requested: bool = False
    finished: bool = False
    last_step: int = -1  # the engine step that last fed it (or admitted it)
    started_at: float = 0.0
    first_token_at: float | None = None

    @property
    def input_size(self) -> int:
        return len(self.input) if isinstance(self.input, tuple) else self.input.size()

    @property
    def prefilling(self) -> bool:
        return bool(self.segments)

    def prefill_left(self) -> int:
        """Positions prefill still feeds, every segment."""
        sizes = (len(seg) if isinstance(seg, tuple) else seg.size() for seg in self.segments)
        return sum(sizes) - self.offset

    def remaining_in_segment(self) -> int:
        seg = self.segments[0]
        size = len(seg) if isinstance(seg, tuple) else seg.size()
        return size - self.offset

    def take_chunk(self, n: int) -> tuple[tuple[int, ...] | None, PreparedInput | None, bool]:
        """The next ``n`` prefill positions as (tokens, prepared, last); advances the cursor."""
        seg = self.segments[0]
        lo, hi = self.offset, self.offset + n
        if isinstance(seg, tuple):
            tokens, prepared = seg[lo:hi], None
        else:
            # A whole PreparedInput is passed as is; a part is a view sharing its storage.
            tokens, prepared = None, (seg if lo == 0 and hi == seg.size() else seg.chunk(lo, hi))
        if seg is self.input:
            self.input_fed += n
        if hi == (len(seg) if isinstance(seg, tuple) else seg.size()):
            self.segments.pop(0)
            self.offset = 0
        else:
            self.offset = hi
        return tokens, prepared, not self.segments

    def accept(self, predicted: tuple[int, ...], base: int) -> tuple[tuple[int, ...], str | None, int, int]:
        """Apply predictions after committed ``base`` (``predicted[-1]`` pending; a stop token or the
        budget cuts the list, the cut token pending): (accepted, finish reason, position, pending)."""
        accepted: list[int] = []
        reason: FinishReason | None = None
        stops = self.config.stop_tokens
        for tok in predicted:
            accepted.append(tok)
            if tok in stops:
                reason = FinishReason.STOP  # checked first: a stop token beats the token budget
                break
            if len(self.tokens) + len(accepted) >= self.config.max_new_tokens:
                reason = FinishReason.LENGTH
                break
        self.tokens.extend(accepted)
        return tuple(accepted), reason, base + len(accepted) - 1, accepted[-1]

    def result(self, reason: FinishReason, error: BaseException | None) -> GenerationResult:
        now = time.perf_counter()
        total = now - self.started_at if self.started_at else 0.0
        tps = 0.0
        if self.first_token_at is not None and len(self.tokens) > 1 and now > self.first_token_at:
            tps = (len(self.tokens) - 1) / (now - self.first_token_at)
        metrics = GenerationMetrics(
            prompt_positions=self.input_fed,
            generated_tokens=len(self.tokens),
            time_to_first_token_s=(self.first_token_at - self.started_at) if self.first_token_at else None,
            decode_tokens_per_s=tps,
            total_s=total,
        )
        message = None
        if reason == FinishReason.ERROR:
            message = str(error) if error is not None else "generation failed"
        return GenerationResult(tuple(self.tokens), reason, message, metrics)
