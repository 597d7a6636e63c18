"""The rates the ``cost`` policy turns positions and load into seconds, measured on the fleet's own
generations and moves: :class:`CostRates` (a value) and :class:`RateMeter` (moving averages the fleet
updates from each ``Done`` and each move). Spec: docs/ROUTING.md#cost-where-the-request-gets-its-first-token-soonest."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from engine_service.api.errors import InvalidArgument

DEFAULT_PREFILL_S_PER_POSITION = 0.0025
DEFAULT_QUEUE_S_PER_GENERATION = 0.25
DEFAULT_OVERHEAD_S = 0.05
DEFAULT_MOVE_OVERHEAD_S = 0.011
DEFAULT_MOVE_S_PER_POSITION = 0.00014  # bench/bench_moves.py: 3 % of a prefilled position
MIN_POSITIONS = 32
MOVE_MIN_POSITIONS = 128
_FLOOR_S = 1e-6  # a rate never reaches 0 (a position is never free)


@dataclass(frozen=True)
class CostRates:
    """Seconds per prefill position, per generation ahead in an engine's queue and per moved position
    (all > 0), the fixed part of every time to first token and of every move (>= 0)."""

    prefill_s_per_position: float = DEFAULT_PREFILL_S_PER_POSITION
    queue_s_per_generation: float = DEFAULT_QUEUE_S_PER_GENERATION
    overhead_s: float = DEFAULT_OVERHEAD_S
    move_overhead_s: float = DEFAULT_MOVE_OVERHEAD_S
    move_s_per_position: float = DEFAULT_MOVE_S_PER_POSITION

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_position", "queue_s_per_generation", "move_s_per_position"):
            value = getattr(self, name)
            if not value > 0:
                raise InvalidArgument(f"{name} must be > 0, got {value!r}")
        for name in ("overhead_s", "move_overhead_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise InvalidArgument(f"{name} must be >= 0, got {value!r}")

    def move_s(self, positions: int) -> float:
        """The expected seconds of moving a snapshot of ``positions`` positions."""
        return self.move_overhead_s + self.move_s_per_position * max(0, positions)


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
        self._overhead = start.overhead_s
        self._move_overhead = start.move_overhead_s
        self._move = start.move_s_per_position
        self.observed = 0  # generations that updated a rate
        self.moves_observed = 0

    def rates(self) -> CostRates:
        with self._lock:
            return CostRates(self._prefill, self._queue, self._overhead, self._move_overhead, self._move)

    def observe(self, load: int, computed_positions: int, ttft_s: float, ahead: int = 0) -> None:
        """One generation: the engine's ``load`` when it was routed there, the positions it computed
        (prompt minus reused), its time to first token and the positions other generations there
        still had to prefill when it was routed (``ahead``)."""
        if ttft_s <= 0 or computed_positions < 0 or load < 0:
            return
        with self._lock:
            net = ttft_s - self._overhead
            if load == 0 and computed_positions < MIN_POSITIONS:
                self._overhead = self._ewma(self._overhead, ttft_s)
            elif load == 0:
                self._prefill = max(_FLOOR_S, self._ewma(self._prefill, net / computed_positions))
            else:
                waited = max(0.0, net - (computed_positions + max(0, ahead)) * self._prefill)
                self._queue = max(_FLOOR_S, self._ewma(self._queue, waited / load))
            self.observed += 1

    def observe_move(self, positions: int, seconds: float) -> None:
        """One finished move of a snapshot of ``positions`` positions that took ``seconds``."""
        if seconds <= 0 or positions < 0:
            return
        with self._lock:
            if positions < MOVE_MIN_POSITIONS:
                self._move_overhead = self._ewma(self._move_overhead, seconds)
            else:
                net = seconds - self._move_overhead
                self._move = max(_FLOOR_S / 100, self._ewma(self._move, net / positions))
            self.moves_observed += 1

    def _ewma(self, current: float, sample: float) -> float:
        return (1 - self._alpha) * current + self._alpha * sample
