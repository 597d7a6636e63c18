"""HandleSweeper: a thread that closes the sessions of handles idle past the registry's timeout
(every ``min(1 s, timeout / 4)``; no thread when expiry is off)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from engine_service.sessions.handles import HandleRegistry

if TYPE_CHECKING:
    from engine_service.runtime.session import Session

log = logging.getLogger(__name__)


class HandleSweeper:
    """See the module docstring. :meth:`start` once, :meth:`stop` when serving ends."""

    def __init__(self, registry: HandleRegistry[Session]) -> None:
        self._registry = registry
        self._stop = threading.Event()
        timeout = registry.idle_timeout_s
        self._interval = min(1.0, timeout / 4) if timeout > 0 else 0.0
        self._thread = threading.Thread(target=self._run, name="forkline-handle-sweeper", daemon=True)

    def start(self) -> None:
        if self._interval > 0:
            self._thread.start()

    def sweep(self) -> int:
        expired = self._registry.expire_idle()
        for r in expired:
            log.info("session handle of %s expired after %.1f s idle", r.owner, self._registry.idle_timeout_s)
            r.value.close()
        return len(expired)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sweep()

    def stop(self) -> None:
        self._stop.set()
