"""EngineHeartbeat: a barrier every ``every_s`` seconds; one unanswered for ``stuck_after_s`` (above the
longest forward: docs/DEPLOY.md) means the engine thread is stuck: ``on_change(False)``, then ``True``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_service.api.checks import checked_float

if TYPE_CHECKING:
    from engine_service.runtime.runner import Runner

log = logging.getLogger(__name__)

DEFAULT_EVERY_S = 1.0
DEFAULT_STUCK_AFTER_S = 30.0


class EngineHeartbeat:
    """:meth:`start` begins, :meth:`stop` ends (idempotent); a stopped runner answers at once."""

    def __init__(
        self,
        runner: Runner,
        on_change: Callable[[bool], None],
        *,
        every_s: float = DEFAULT_EVERY_S,
        stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
    ) -> None:
        checked_float("every_s", every_s, lo=0, lo_open=True)
        checked_float("stuck_after_s", stuck_after_s, lo=0, lo_open=True)
        self.runner, self.on_change = runner, on_change
        self.every_s, self.stuck_after_s = every_s, stuck_after_s
        self.alive = True
        self.last_answer = time.monotonic()  # when the engine thread last answered a barrier
        self.longest_wait_s = 0.0  # the longest a barrier waited for the engine thread so far
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="forkline-engine-heartbeat", daemon=True)

    @property
    def age_s(self) -> float:
        """Seconds since the engine thread last answered (0 while a barrier is not yet due)."""
        return max(0.0, time.monotonic() - self.last_answer - self.every_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.stuck_after_s + 1.0)

    def _run(self) -> None:
        while not self._stopped.is_set():
            sent = time.monotonic()
            answered = threading.Event()
            threading.Thread(target=self._ping, args=(answered,), daemon=True).start()
            while not answered.wait(min(self.every_s, self.stuck_after_s)):
                if self._stopped.is_set():
                    return
                if time.monotonic() - sent >= self.stuck_after_s:
                    self._set(False, time.monotonic() - sent)
            waited = time.monotonic() - sent
            self.longest_wait_s = max(self.longest_wait_s, waited)
            self.last_answer = time.monotonic()
            self._set(True, waited)
            self._stopped.wait(self.every_s)

    def _ping(self, answered: threading.Event) -> None:
        try:
            self.runner.flush()
        except Exception:  # noqa: BLE001 - a stopped or failed runner answers too: the caller decides
            log.debug("heartbeat barrier failed", exc_info=True)
        answered.set()

    def _set(self, alive: bool, waited: float) -> None:
        if alive == self.alive:
            return
        self.alive = alive
        if alive:
            log.warning("the engine thread answers again (after %.1f s)", waited)
        else:
            log.error("the engine thread has not answered for %.1f s: reporting NOT_SERVING", waited)
        try:
            self.on_change(alive)
        except Exception:  # noqa: BLE001
            log.warning("heartbeat callback failed", exc_info=True)
