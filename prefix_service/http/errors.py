"""The one place an error becomes an HTTP status and OpenAI's error JSON (the table: ``_KINDS``). A bad
field names itself in ``error.param``; a bug is a 500 logged once with its text withheld; a NotFound
from the engine (it lost a session, e.g. restarted) is a retryable 503."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine_service.api import errors as e
from prefix_service.http.protocol import ErrorBody, ErrorDetail

log = logging.getLogger(__name__)

INTERNAL_DETAILS = "internal error"


class ApiError(Exception):
    """An HTTP-level refusal that has no forkline type (auth, unknown model or route)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


class BadField(e.InvalidArgument):
    """An InvalidArgument about one request field (``param`` as the request spells it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class _Kind:
    status: int
    type: str
    code: str | None = None


# Checked in order: the first matching class decides.
_KINDS: tuple[tuple[type[BaseException], _Kind], ...] = (
    (e.InvalidArgument, _Kind(400, "invalid_request_error")),
    (e.Unauthenticated, _Kind(401, "invalid_request_error", "invalid_api_key")),
    (e.ResourceExhausted, _Kind(429, "rate_limit_error", "resource_exhausted")),
    (e.Unavailable, _Kind(503, "service_unavailable")),
    (e.Cancelled, _Kind(503, "service_unavailable")),
    (e.NotFound, _Kind(503, "service_unavailable")),
    (e.ForklineError, _Kind(500, "server_error")),
)


def error_body(exc: BaseException) -> tuple[int, ErrorBody]:
    """The HTTP status and OpenAI error body for ``exc``."""
    if isinstance(exc, ApiError):
        return exc.status, _body(exc.message, exc.type, exc.param, exc.code)
    if isinstance(exc, ValidationError):
        return 400, _validation_body(exc)
    for cls, kind in _KINDS:
        if isinstance(exc, cls):
            param = exc.param if isinstance(exc, BadField) else None
            return kind.status, _body(str(exc) or cls.__name__, kind.type, param, kind.code)
    log.error("internal error answering an HTTP request", exc_info=exc)
    return 500, _body(INTERNAL_DETAILS, "server_error")


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def error_event(exc: BaseException) -> str:
    """An error inside an already started event stream, as its server-sent ``data:`` line."""
    return f"data: {error_body(exc)[1].model_dump_json()}\n\n"


def _body(message: str, type: str, param: str | None = None, code: str | None = None) -> ErrorBody:
    return ErrorBody(error=ErrorDetail(message=message, type=type, param=param, code=code))


def field_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic location as the request spells it: ``messages[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_type_tag(part):
            out += f".{part}" if out else str(part)
    return out


def _is_type_tag(part: str) -> bool:
    """Union members pydantic names in a location (``str``, ``list[TextPart]``, ``function-after``)."""
    return part in ("str", "int", "float", "bool", "dict") or "[" in part or "-" in part


def _validation_body(exc: ValidationError) -> ErrorBody:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        if "EOF while parsing a value at line 1 column 0" in detail:
            return _body("the request body is empty: expected a JSON object", "invalid_request_error")
        return _body(f"the request body is not valid JSON: {detail}", "invalid_request_error")
    if not first["loc"] and first["type"] in ("model_type", "model_attributes_type"):
        return _body("the request body must be a JSON object", "invalid_request_error")
    param = field_path(tuple(first["loc"]))
    if first["type"] == "missing":
        return _body(f"{param} is required", "invalid_request_error", param)
    got = json.dumps(first.get("input"), default=str)
    if len(got) > 80:
        got = got[:77] + "..."
    # a union reports one error per member: the first already says what the field must be
    return _body(f"{param}: {first['msg']} (got {got})", "invalid_request_error", param)


def answering_errors(
    handler: Callable[[Request], Awaitable[Response]],
    respond: Callable[[BaseException], Response] | None = None,
) -> Callable[[Request], Awaitable[Response]]:
    """Every exception ``handler`` raises becomes an error answer: ``respond``'s (an API's own error
    shape), by default OpenAI's JSON (:func:`error_response` decides how, and logs bugs once)."""
    shape = respond or error_response

    @functools.wraps(handler)
    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:  # noqa: BLE001 - the shape maps forkline errors and logs bugs once
            return shape(exc)

    return answer
