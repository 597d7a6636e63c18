"""Checkpoints: the snapshots a gateway capture takes inside a prompt where a divergence is likely
(message ends, and branch points: where stored prompts already diverged from it; stride points only
when asked), so a later prompt diverging there still reuses an exact prefix on an engine whose ring
evicts window rows; each is an ordinary cache entry (``boundary="breakpoint"``). Spec: docs/SNAPSHOTS.md#sliding-window-models-checkpoints-inside-a-stored-prompt."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine_service.api.errors import InvalidArgument
from prefix_service.cache.budget import Reservation

log = logging.getLogger(__name__)

DEFAULT_CHECKPOINT_STRIDE = 0  # --checkpoint_stride (off: checkpoints where divergences are likely)
DEFAULT_MAX_CHECKPOINTS = 8  # --max_checkpoints (llama.cpp's --ctx-checkpoints default is 8 as well)


@dataclass(frozen=True)
class CheckpointPlan:
    """``stride``: positions between stride checkpoints (0: none; message ends and branch points
    still); ``max_checkpoints``: at most this many per captured prompt (0: no checkpoints at all)."""

    stride: int = DEFAULT_CHECKPOINT_STRIDE
    max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS

    def __post_init__(self) -> None:
        for name in ("stride", "max_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"checkpoint {name} must be an int >= 0, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.max_checkpoints > 0

    def for_cache(self, max_entries: int) -> CheckpointPlan:
        """One prompt's snapshots take at most half the cache's entries: a long prompt never flushes it."""
        return self.limited(max_entries // 2 - 1)

    def message_ends(self, window_evicts: bool) -> int:
        """How many of a chat's message ends to ask the engine for (0 where no checkpoint is taken)."""
        return self.max_checkpoints if self.enabled and window_evicts else 0

    def limited(self, most: int) -> CheckpointPlan:
        """This plan with at most ``most`` checkpoints (the gateway: fewer than half its cache)."""
        return replace(self, max_checkpoints=max(0, min(self.max_checkpoints, most)))


def checkpoint_positions(
    plan: CheckpointPlan,
    prompt_length: int,
    reused: int,
    message_ends: Sequence[int] = (),
    branch_points: Sequence[int] = (),
) -> tuple[int, ...]:
    """The checkpoints of one capture, ascending: message ends, branch points and multiples of
    ``plan.stride`` (when on) strictly between ``reused`` and ``prompt_length``, at most
    ``plan.max_checkpoints`` (message ends and branch points first, the latest kept; stride points
    thinned evenly, the last kept)."""
    if not plan.enabled:
        return ()
    inside = range(reused + 1, prompt_length)
    ends = sorted({p for p in (*message_ends, *branch_points) if p in inside})[-plan.max_checkpoints :]
    if not plan.stride:
        return tuple(ends)
    first = (reused // plan.stride + 1) * plan.stride
    stride = [p for p in range(first, prompt_length, plan.stride) if p not in ends]
    room = plan.max_checkpoints - len(ends)
    if room <= 0:
        stride = []
    elif len(stride) > room:  # evenly spaced multiples of the stride, the last one kept
        stride = [stride[(i + 1) * len(stride) // room - 1] for i in range(room)]
    return tuple(sorted((*ends, *stride)))


class SnapshotRoom:
    """One gateway call's reservations, by the snapshot position each was taken for (the prompt end
    and every checkpoint). :meth:`take` hands one to the insert of its snapshot; :meth:`release` gives
    back what is left (idempotent)."""

    def __init__(self) -> None:
        self._held: dict[int, Reservation] = {}
        self._lock = threading.Lock()

    def add(self, position: int, reservation: Reservation) -> None:
        with self._lock:
            previous = self._held.pop(position, None)
            self._held[position] = reservation
        if previous is not None:
            previous.release()

    def holds(self, position: int) -> bool:
        with self._lock:
            return position in self._held

    def positions(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._held))

    def take(self, position: int) -> Reservation | None:
        with self._lock:
            return self._held.pop(position, None)

    def release(self) -> None:
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for reservation in held:
            reservation.release()
