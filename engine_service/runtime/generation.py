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
    """One callback event, on the engine thread; the terminal one sets ``finished``, ``finish_reason``
    and (failed) ``error``."""

    tokens: tuple[int, ...]  # since the previous update (none: a prefill chunk); the last one is pending
    position: int  # committed, the pending token excluded
    breakpoint: int | None = None  # == position on the update that ends prefill at a breakpoint
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # with top_logprobs: one per token, no text yet

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
    """Times in seconds from the start command; ``decode_tokens_per_s`` counts tokens after the first."""

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
    """The caller's view of one generation (thread-safe): errors travel as values (``finish_reason``
    ERROR, :attr:`error`). It keeps its session alive until the generation ends."""

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
        """Block until the generation ends (TimeoutError); never from a runner callback."""
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
