"""The rates the ``cost`` routing policy turns positions and load into seconds, measured on the fleet's
own generations: :class:`CostRates` (a value) and :class:`RateMeter` (what the fleet updates from each
generation's ``Done`` and reads at each route).

- ``prefill_s_per_position``: time to first token / computed positions, over generations that started
  on an engine with nothing else running or queued there (their TTFT is their prefill alone).
- ``queue_s_per_generation``: what one generation already running or queued on the engine adds to a
  new one's time to first token: (TTFT - computed positions x the prefill rate) / load, over
  generations that started with load >= 1.

Each is an exponential moving average (weight ``alpha`` for the newest observation), starting from
the defaults below (measured with SmolLM2-135M on this project's 2-core CPU machine, see
docs/DEPLOY.md "Routing"); observations with fewer than ``MIN_POSITIONS`` computed positions are
skipped for the prefill rate (their TTFT is mostly overhead).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from engine_service.api.errors import InvalidArgument

DEFAULT_PREFILL_S_PER_POSITION = 0.0015
DEFAULT_QUEUE_S_PER_GENERATION = 0.25
MIN_POSITIONS = 16
_FLOOR_S = 1e-6  # a rate never reaches 0 (a position is never free)


@dataclass(frozen=True)
class CostRates:
    """Seconds per prefill position and per generation ahead in an engine's queue (both > 0)."""

    prefill_s_per_position: float = DEFAULT_PREFILL_S_PER_POSITION
    queue_s_per_generation: float = DEFAULT_QUEUE_S_PER_GENERATION

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_position", "queue_s_per_generation"):
            value = getattr(self, name)
            if not value > 0:
                raise InvalidArgument(f"{name} must be > 0, got {value!r}")


class RateMeter:
    """See the module docstring; thread-safe. ``observe`` is called once per finished generation."""

    def __init__(self, start: CostRates | None = None, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise InvalidArgument(f"alpha must be in (0, 1], got {alpha!r}")
        start = start or CostRates()
        self._alpha = alpha
        self._lock = threading.Lock()
        self._prefill = start.prefill_s_per_position
        self._queue = start.queue_s_per_generation
        self.observed = 0  # generations that updated a rate

    def rates(self) -> CostRates:
        with self._lock:
            return CostRates(self._prefill, self._queue)

    def observe(self, load: int, computed_positions: int, ttft_s: float) -> None:
        """One generation: the engine's ``load`` when it was routed there, the positions it computed
        (prompt minus reused) and its time to first token."""
        if ttft_s <= 0 or computed_positions < 0 or load < 0:
            return
        with self._lock:
            if load == 0:
                if computed_positions < MIN_POSITIONS:
                    return
                sample = ttft_s / computed_positions
                self._prefill = max(_FLOOR_S, self._ewma(self._prefill, sample))
            else:
                waited = max(0.0, ttft_s - computed_positions * self._prefill)
                self._queue = max(_FLOOR_S, self._ewma(self._queue, waited / load))
            self.observed += 1

    def _ewma(self, current: float, sample: float) -> float:
        return (1 - self._alpha) * current + self._alpha * sample
