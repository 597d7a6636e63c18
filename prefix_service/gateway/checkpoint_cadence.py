"""CheckpointCadence: how often a generation takes a decode checkpoint so that a resume recomputes at
most N positions (``--resume_checkpoint_tokens N``). A checkpoint protects a resume from a killed
engine only once the snapshot directory holds it; the positions the stream moves on while it is
written (its lag) count against N, so the engine is asked for one every N - lag generated tokens, lag
the largest of the recent ones measured (each stream notes how far it had got when its checkpoint's
file was there: :meth:`landed`). Spec: docs/RESUME.md#decode-checkpoints."""

from __future__ import annotations

import threading
from collections import deque

DEFAULT_LAG = 4  # positions a checkpoint's write is assumed to take before one is measured
RECENT = 32  # the lags the stride follows: the largest of these


class CheckpointCadence:
    """``every`` N (0: no checkpoints); ``measured`` False: checkpoints land nowhere a resume restores
    from (no snapshot directory), the stride is N as asked."""

    def __init__(self, every: int, measured: bool) -> None:
        self.every, self.measured = every, measured
        self._lags: deque[int] = deque(maxlen=RECENT)
        self._lock = threading.Lock()

    def stride(self) -> int:
        """Generated tokens between two checkpoints (0: none); never below half of N, so a slow disk
        cannot make every token a checkpoint."""
        if not self.every or not self.measured:
            return self.every
        with self._lock:
            lag = max(self._lags, default=DEFAULT_LAG)
        return max(self.every - lag, (self.every + 1) // 2, 1)

    def landed(self, lag: int) -> None:
        """A checkpoint was in the directory when the stream held ``lag`` positions past it (at most)."""
        with self._lock:
            self._lags.append(max(0, lag))

    def lags(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._lags)
