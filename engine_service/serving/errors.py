"""The one place that maps forkline errors to gRPC status codes (with an ``ErrorInfo`` for typed
refusals) and back for clients. Servicers raise inside :func:`status_on_error`; anything else escaping
is a bug, logged and answered INTERNAL. Spec: docs/ARCHITECTURE.md (errors and status codes).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

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


def error_for(
    code: grpc.StatusCode, message: str, info: error_details_pb2.ErrorInfo | None = None
) -> e.ForklineError:
    """The forkline error for a failed call: the typed refusal its ``ErrorInfo`` names, if any."""
    category = _FROM_CODE.get(code, e.ForklineError)
    if info is None or info.domain != e.ERROR_DOMAIN:
        return category(message)
    return e.from_details(category, message, info.reason, dict(info.metadata))


def error_info(exc: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ``ErrorInfo`` detail a failed call's status carries, or None."""
    if not hasattr(exc, "trailing_metadata"):
        return None
    try:
        status = rpc_status.from_call(exc)
    except ValueError:  # a status detail that disagrees with the call's code or message
        return None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


def from_rpc_error(exc: grpc.RpcError) -> e.ForklineError:
    """Convert a failed call (``grpc.RpcError`` that is also a ``grpc.Call``) to a forkline error."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_for(code, details or code.name, error_info(exc))


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, error: e.ForklineError) -> None:
    """End the call with ``code`` and ``error``'s message, and its ErrorInfo when it has a reason."""
    message = str(error) or type(error).__name__
    if error.reason is None:
        context.abort(code, message)
    detail = any_pb2.Any()
    detail.Pack(
        error_details_pb2.ErrorInfo(reason=error.reason, domain=e.ERROR_DOMAIN, metadata=error.details())
    )
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    context.abort_with_status(rpc_status.to_status(status))


@contextlib.contextmanager
def status_on_error(context: grpc.ServicerContext) -> Iterator[None]:
    """Abort the call with the mapped status when the body raises (``context.abort`` raises itself)."""
    try:
        yield
    except grpc.RpcError as exc:  # a call this servicer made to another service failed: pass it on
        mapped = from_rpc_error(exc)
        _abort(context, code_for(mapped) or grpc.StatusCode.UNKNOWN, mapped)
    except Exception as exc:
        code = code_for(exc)
        if code is None or not isinstance(exc, e.ForklineError):  # a bug: the traceback goes to the log
            log.exception("internal error in an RPC handler (%s)", type(exc).__name__)
            context.abort(grpc.StatusCode.INTERNAL, INTERNAL_DETAILS)
        _abort(context, code, exc)
