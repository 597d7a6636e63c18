"""Errors of the Messages API in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``:
the status comes from the door's one table (``errors.py``); a bad field names itself in the message."""

from __future__ import annotations

import json

from pydantic import ValidationError
from starlette.responses import JSONResponse

from prefix_service.http.errors import error_body, field_path
from prefix_service.http.messages_protocol import BLOCK_TYPES

# HTTP status -> Anthropic's error type (anything else: api_error)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
OVERLOADED = 529  # Anthropic's status for "try again later" (the door's 503)


def anthropic_error(exc: BaseException) -> tuple[int, dict]:
    """The status and Anthropic error body for ``exc``."""
    if isinstance(exc, ValidationError):
        status, message = 400, _validation_message(exc)
    else:
        status, body = error_body(exc)
        message = body.error.message
        status = OVERLOADED if status == 503 else status
    return status, {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }


def error_response(exc: BaseException) -> JSONResponse:
    status, body = anthropic_error(exc)
    return JSONResponse(body, status_code=status)


def error_event(exc: BaseException) -> str:
    """An error inside a started stream, as Anthropic's ``error`` event."""
    return f"event: error\ndata: {json.dumps(anthropic_error(exc)[1])}\n\n"


def _path(loc: tuple[int | str, ...]) -> str:
    """A pydantic location as the request spells it, without the union's member and tag names."""
    kept: list[int | str] = []
    tag_next = False
    for part in loc:
        if isinstance(part, str) and "tagged-union" in part:
            tag_next = True  # the next index's following part is the block's type
            continue
        if tag_next and isinstance(part, str) and kept and isinstance(kept[-1], int):
            tag_next = False
            continue
        kept.append(part)
    return field_path(tuple(kept))


def _validation_message(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        return (
            f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', errors[0]['msg'])}"
        )
    if not errors[0]["loc"]:
        return "the request body must be a JSON object"
    error = max(errors, key=lambda e: len(e["loc"]))  # a union's deepest complaint says the most
    path = _path(tuple(error["loc"]))
    kind = error["type"]
    if kind == "missing":
        return f"{path}: field required"
    if kind == "extra_forbidden":
        return f"{path}: unknown field, or one forkline does not implement"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tag = error.get("ctx", {}).get("tag", "")
        return f"{path}.type: {tag!r} blocks are not supported (only {', '.join(BLOCK_TYPES)})"
    got = json.dumps(error.get("input"), default=str)
    got = got if len(got) <= 80 else got[:77] + "..."
    return f"{path}: {error['msg']} (got {got})"
