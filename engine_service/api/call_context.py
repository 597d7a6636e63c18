"""CallContext: who a call acts for, with what credential, until when; made at a door, passed down."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CallContext:
    """``owner`` is the tenant the call acts for (from the credential when auth is on); ``credential`` is
    what the door forwards to engines (a bearer token, "" without one); ``deadline`` is a
    ``time.monotonic()`` instant or None for no deadline."""

    owner: str
    credential: str = ""
    deadline: float | None = None
    cache_scope: str | None = None  # the prefix scope its texts are tokenized in (``Tokenize``)

    def remaining(self) -> float | None:
        """Seconds left before the deadline (never below 0), or None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def acting_as(self, owner: str) -> CallContext:
        """The same call acting for ``owner`` (a service acting under its own identity)."""
        return replace(self, owner=owner)

    def with_timeout(self, seconds: float | None) -> CallContext:
        """This context with its deadline at most ``seconds`` from now."""
        if seconds is None:
            return self
        deadline = time.monotonic() + seconds
        return replace(self, deadline=deadline if self.deadline is None else min(deadline, self.deadline))
