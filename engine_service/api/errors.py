"""Every error forkline raises on purpose (one status code per class: ``serving/errors.py``), and the
typed refusals programs act on, carried as ``google.rpc.ErrorInfo`` and rebuilt by :func:`from_details`.
A builtin exception is a broken internal contract (INTERNAL). Spec: docs/ARCHITECTURE.md (errors).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

ERROR_DOMAIN = "forkline.engine.v1"


class ErrorReason(StrEnum):
    """``ErrorInfo.reason`` of a refusal a program acts on."""

    OWNER_SESSIONS_QUOTA = "OWNER_SESSIONS_QUOTA"  # the owner holds its quota's sessions
    OWNER_POSITIONS_QUOTA = "OWNER_POSITIONS_QUOTA"  # ... or positions
    ENGINE_FULL = "ENGINE_FULL"  # the engine has no free session slot (max_sessions)
    STOPPING = "STOPPING"  # the engine or service is shutting down
    INVALID_JSON_SCHEMA = "INVALID_JSON_SCHEMA"  # a json_schema the engine cannot compile


class ForklineError(Exception):
    """Base of every deliberate forkline error. ``reason``: set by refusals a program acts on."""

    reason: ErrorReason | None = None

    def details(self) -> dict[str, str]:
        return {}

    @classmethod
    def from_details(cls, message: str, details: Mapping[str, str]) -> ForklineError:
        """The error as the other side of the wire raised it (``message`` kept as sent)."""
        return cls(message)


class InvalidArgument(ForklineError, ValueError):
    """The caller sent something malformed (bad field, token id outside the vocabulary, ...)."""


class InvalidJsonSchema(InvalidArgument):
    """``GenConfig.json_schema`` is not JSON or not a schema the grammar compiler accepts."""

    reason = ErrorReason.INVALID_JSON_SCHEMA


class NotFound(ForklineError, LookupError):
    """An unknown, forged, expired or closed handle / sequence id."""

    def __str__(self) -> str:  # LookupError would quote the message like a KeyError
        return str(self.args[0]) if self.args else ""


class ResourceExhausted(ForklineError):
    """No room: session slots, token capacity, cache entries."""


class QuotaExceeded(ResourceExhausted):
    """``owner`` holds ``held`` ``unit`` ("sessions" / "positions") and needs ``needed`` more past
    ``quota`` (the flag's name, e.g. ``owner_max_sessions``), whose value is ``limit``."""

    def __init__(
        self,
        owner: str,
        held: int,
        unit: str,
        quota: str,
        limit: int,
        needed: int = 1,
        *,
        message: str | None = None,
    ) -> None:
        if unit not in ("sessions", "positions"):
            raise ValueError(f"unit must be 'sessions' or 'positions', got {unit!r}")
        more = f" and needs {needed} more" if unit == "positions" else ""
        super().__init__(message or f"owner '{owner}' holds {held} {unit}{more}, {quota}={limit}")
        self.owner, self.held, self.unit, self.quota = owner, held, unit, quota
        self.limit, self.needed = limit, needed

    @property
    def reason(self) -> ErrorReason:
        return (
            ErrorReason.OWNER_SESSIONS_QUOTA if self.unit == "sessions" else ErrorReason.OWNER_POSITIONS_QUOTA
        )

    def details(self) -> dict[str, str]:
        return {
            "owner": self.owner,
            "unit": self.unit,
            "held": str(self.held),
            "needed": str(self.needed),
            "limit": str(self.limit),
            "quota": self.quota,
        }

    @classmethod
    def from_details(cls, message: str, details: Mapping[str, str]) -> QuotaExceeded:
        return cls(
            details["owner"],
            int(details["held"]),
            details["unit"],
            details["quota"],
            int(details["limit"]),
            int(details["needed"]),
            message=message,
        )


class EngineFull(ResourceExhausted):
    """The engine holds ``max_sessions`` resident sessions: none is free for a new one."""

    reason = ErrorReason.ENGINE_FULL

    def __init__(self, max_sessions: int, *, message: str | None = None) -> None:
        super().__init__(message or f"no free session slot (max_sessions={max_sessions})")
        self.max_sessions = max_sessions

    def details(self) -> dict[str, str]:
        return {"limit": str(self.max_sessions)}

    @classmethod
    def from_details(cls, message: str, details: Mapping[str, str]) -> EngineFull:
        return cls(int(details["limit"]), message=message)


class FailedPrecondition(ForklineError):
    """The object is in the wrong state (poisoned session, session already generating, ...)."""


class Unavailable(ForklineError):
    """The engine or service is stopping or unreachable."""


class Stopping(Unavailable):
    """The engine or service is shutting down: it takes no new work (try another, or later)."""

    reason = ErrorReason.STOPPING


class Unauthenticated(ForklineError):
    """The call carries no valid credential (missing, malformed or unknown bearer token)."""


class ModelLoadError(InvalidArgument):
    """A model file or folder cannot be loaded. ``str()`` is one line naming the path and the problem."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class CacheError(ForklineError):
    """A KV-cache misuse the caller must not ignore (ordinary refusals are ``None`` / ``False``)."""


class GenerationError(ForklineError):
    """A generation failed; ``str()`` says why (executor failure, callback exception, ...)."""


class Cancelled(ForklineError):
    """The operation was cancelled (by the caller or by shutdown)."""


_BY_REASON: dict[ErrorReason, type[ForklineError]] = {
    ErrorReason.OWNER_SESSIONS_QUOTA: QuotaExceeded,
    ErrorReason.OWNER_POSITIONS_QUOTA: QuotaExceeded,
    ErrorReason.ENGINE_FULL: EngineFull,
    ErrorReason.STOPPING: Stopping,
    ErrorReason.INVALID_JSON_SCHEMA: InvalidJsonSchema,
}


def from_details(
    category: type[ForklineError], message: str, reason: str, details: Mapping[str, str]
) -> ForklineError:
    """The typed refusal ``reason`` and ``details`` stand for when known and well-formed, else
    ``category(message)``."""
    try:
        kind = _BY_REASON.get(ErrorReason(reason))
    except ValueError:
        kind = None
    if kind is None or not issubclass(kind, category):
        return category(message)
    try:
        return kind.from_details(message, details)
    except (KeyError, ValueError):
        return category(message)
