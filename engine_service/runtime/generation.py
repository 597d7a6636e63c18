"""What a generation reports: streamed updates, the final result, metrics, and the caller's handle."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_service.api.errors import FailedPrecondition
from engine_service.api.logprobs import TokenLogprob
from engine_service.api.stream_events import FinishReason

if TYPE_CHECKING:
    from engine_service.runtime.session import Session


def _finish_reason(value: str) -> FinishReason:
    try:
        return FinishReason(value)
    except ValueError:
        raise ValueError(
            f"finish_reason must be one of {[r.value for r in FinishReason]}, got {value!r}"
        ) from None


@dataclass(frozen=True)
class GenerationUpdate:
    """One callback event, delivered on the engine thread.

    tokens: tokens returned since the previous update (may be empty: a prefill chunk or a terminal
        update). The last token a generation returns is the session's pending prediction.
    position: the session's committed position after this update (the pending token excluded).
    breakpoint: set (== position) on the update that ends prefill at a ``prefill_breakpoints`` entry.
    finished / finish_reason / error: set on the single terminal update.
    logprobs: with ``GenConfig.top_logprobs``, one entry per token (ids and values; no text yet).
    """

    tokens: tuple[int, ...]
    position: int
    breakpoint: int | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()

    def __post_init__(self) -> None:
        if self.position < 0:
            raise ValueError(f"position must be >= 0, got {self.position}")
        if self.finished != (self.finish_reason is not None):
            raise ValueError("finish_reason must be set exactly when finished")
        if self.finish_reason is not None:
            object.__setattr__(self, "finish_reason", _finish_reason(self.finish_reason))
        if self.breakpoint is not None and self.breakpoint != self.position:
            raise ValueError(f"breakpoint {self.breakpoint} must equal position {self.position}")


@dataclass(frozen=True)
class GenerationMetrics:
    """prompt_positions: input positions consumed (a prepared input counts its positions, not tokens).
    generated_tokens: tokens returned. Times are seconds from the start command being handled.
    decode_tokens_per_s: tokens after the first over the time after the first (0.0 when undefined).
    """

    prompt_positions: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float | None = None
    decode_tokens_per_s: float = 0.0
    total_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt_positions < 0:
            raise ValueError(f"prompt_positions must be >= 0, got {self.prompt_positions}")
        if self.generated_tokens < 0:
            raise ValueError(f"generated_tokens must be >= 0, got {self.generated_tokens}")


@dataclass(frozen=True)
class GenerationResult:
    """The final state of a generation: every returned token, why it ended, and its metrics."""

    tokens: tuple[int, ...]
    finish_reason: FinishReason
    error: str | None
    metrics: GenerationMetrics

    def __post_init__(self) -> None:
        object.__setattr__(self, "finish_reason", _finish_reason(self.finish_reason))
        if (self.finish_reason == FinishReason.ERROR) != (self.error is not None):
            raise ValueError("error must be set exactly when finish_reason is 'error'")


class GenerationHandle:
    """The caller's view of one generation. Thread-safe; settled once by the engine thread.

    ``wait`` returns the :class:`GenerationResult` (errors travel as values: ``finish_reason ==
    FinishReason.ERROR`` and :attr:`error` holds the exception, e.g. an ``InvalidArgument`` for a bad input).
    The handle keeps its session alive, so a session nobody else holds is not closed mid-generation.
    """

    def __init__(self, session: Session, request_cancel: Callable[[], None]) -> None:
        self._session = session
        self._request_cancel = request_cancel
        self._done = threading.Event()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None

    @property
    def session(self) -> Session:
        return self._session

    def wait(self, timeout: float | None = None) -> GenerationResult:
        """Block until the generation ends; TimeoutError when ``timeout`` passes first.

        Never call this from a runner callback (the engine thread would wait for itself).
        """
        if not self._done.is_set() and threading.current_thread() is self._session._runner.engine_thread:
            raise FailedPrecondition("wait() from a runner callback would block the engine thread forever")
        if not self._done.wait(timeout):
            raise TimeoutError(f"generation still running after {timeout} s")
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        """Ask the engine to stop this generation (a no-op once done). Safe from callbacks."""
        if not self._done.is_set():
            self._request_cancel()

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._result.finish_reason if self._result is not None else None

    @property
    def error(self) -> BaseException | None:
        """The exception that failed the generation, or None."""
        return self._error if self._done.is_set() else None

    @property
    def metrics(self) -> GenerationMetrics | None:
        return self._result.metrics if self._result is not None else None

    def _settle(self, result: GenerationResult, error: BaseException | None) -> None:
        """Engine thread only: publish the result and wake waiters (once)."""
        if self._done.is_set():
            return
        self._error = error
        self._result = result
        self._done.set()
