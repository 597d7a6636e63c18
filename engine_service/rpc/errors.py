"""The one place that maps forkline errors to gRPC status codes, and back (for clients).

Servicers wrap their bodies in :func:`status_on_error` and raise (never call ``context.abort``). Only
forkline's own error types (:mod:`engine_service.api.errors`) are answers to the client: they abort the
call with the mapped code and the error's message. Input problems are never INTERNAL, so validation
raises those types (``InvalidArgument``, ``NotFound``, ...), never a builtin ``ValueError`` /
``KeyError``. Anything else -- a builtin ``KeyError``, ``IndexError``, ``ValueError``, ... escaping a
servicer -- is a bug: it is logged once with its traceback and the call ends INTERNAL with a generic
message (the exception text can carry server internals and is not sent). A failed outgoing call (the
prefix service calling the engine) keeps the engine's status code.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import grpc

from engine_service.api import errors as e

log = logging.getLogger(__name__)

# Most specific first: ModelLoadError is an InvalidArgument, ...
_TO_CODE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (e.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (e.NotFound, grpc.StatusCode.NOT_FOUND),
    (e.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (e.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (e.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (e.Cancelled, grpc.StatusCode.CANCELLED),
    (e.CacheError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.GenerationError, grpc.StatusCode.ABORTED),
    (e.ForklineError, grpc.StatusCode.UNKNOWN),
    # Nothing else: a builtin ValueError / LookupError is a bug (INTERNAL), not an answer.
)

INTERNAL_DETAILS = "internal error (the server logged the details)"

_FROM_CODE: dict[grpc.StatusCode, type[e.ForklineError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: e.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: e.NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: e.ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: e.FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: e.Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: e.Unauthenticated,
    grpc.StatusCode.CANCELLED: e.Cancelled,
    grpc.StatusCode.DEADLINE_EXCEEDED: e.Unavailable,
    grpc.StatusCode.ABORTED: e.GenerationError,
}


def code_for(exc: BaseException) -> grpc.StatusCode | None:
    """The status code for a deliberate (forkline) error, or None for a bug (anything else)."""
    for kind, code in _TO_CODE:
        if isinstance(exc, kind):
            return code
    return None


def error_for(code: grpc.StatusCode, details: str) -> e.ForklineError:
    """The forkline error a client raises for a failed call (unknown codes: ForklineError)."""
    return _FROM_CODE.get(code, e.ForklineError)(details)


def from_rpc_error(exc: grpc.RpcError) -> e.ForklineError:
    """Convert a failed call (``grpc.RpcError`` that is also a ``grpc.Call``) to a forkline error."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_for(code, details or code.name)


@contextlib.contextmanager
def status_on_error(context: grpc.ServicerContext) -> Iterator[None]:
    """Abort the call with the mapped status when the body raises (``context.abort`` raises itself)."""
    try:
        yield
    except grpc.RpcError as exc:  # a call this servicer made to another service failed: pass it on
        mapped = from_rpc_error(exc)
        context.abort(code_for(mapped) or grpc.StatusCode.UNKNOWN, str(mapped))
    except Exception as exc:
        code = code_for(exc)
        if code is None:  # a bug: the traceback goes to the log, never to the client
            log.exception("internal error in an RPC handler (%s)", type(exc).__name__)
            context.abort(grpc.StatusCode.INTERNAL, INTERNAL_DETAILS)
        context.abort(code, str(exc) or type(exc).__name__)
