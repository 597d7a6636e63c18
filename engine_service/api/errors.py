"""Every error forkline raises on purpose, in one place.

Each class carries the gRPC-independent *category* the rpc layer maps to a status code
(``rpc/errors.py`` is the only place that knows the codes):

=====================  =====================
category               gRPC status
=====================  =====================
InvalidArgument        INVALID_ARGUMENT
NotFound               NOT_FOUND
ResourceExhausted      RESOURCE_EXHAUSTED
FailedPrecondition     FAILED_PRECONDITION
Unavailable            UNAVAILABLE
Unauthenticated        UNAUTHENTICATED
Cancelled              CANCELLED
CacheError             FAILED_PRECONDITION
GenerationError        ABORTED
=====================  =====================

Only these types are answers. Validation of anything a caller supplies (a request field, a config
value, a model file) raises one of them -- ``InvalidArgument`` stays a ``ValueError`` and ``NotFound``
a ``LookupError`` for code that catches the builtins. A builtin exception (``ValueError``,
``KeyError``, ``IndexError``, ...) means a broken internal contract: a service logs it with its
traceback and answers INTERNAL without its text.

Messages name the offending field or file (``"max_new_tokens must be > 0, got -1"``).
"""

from __future__ import annotations


class ForklineError(Exception):
    """Base of every deliberate forkline error."""


class InvalidArgument(ForklineError, ValueError):
    """The caller sent something malformed (bad field, token id outside the vocabulary, ...)."""


class NotFound(ForklineError, LookupError):
    """An unknown, forged, expired or closed handle / sequence id."""

    def __str__(self) -> str:  # LookupError would quote the message like a KeyError
        return str(self.args[0]) if self.args else ""


class ResourceExhausted(ForklineError):
    """No room: session slots, token capacity, cache entries."""


class FailedPrecondition(ForklineError):
    """The object is in the wrong state (poisoned session, session already generating, ...)."""


class Unavailable(ForklineError):
    """The engine or service is stopping or unreachable."""


class Unauthenticated(ForklineError):
    """The call carries no valid credential (missing, malformed or unknown bearer token)."""


class ModelLoadError(InvalidArgument):
    """A model file or folder cannot be loaded. ``str()`` is one line naming the path and the problem."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class CacheError(ForklineError):
    """A KV-cache operation was refused in a way the caller must not ignore (misuse, not a refusal).

    Ordinary refusals (no room, boundary unavailable) are reported as ``None`` / ``False``.
    """


class GenerationError(ForklineError):
    """A generation failed; ``str()`` says why (executor failure, callback exception, ...)."""


class Cancelled(ForklineError):
    """The operation was cancelled (by the caller or by shutdown)."""
