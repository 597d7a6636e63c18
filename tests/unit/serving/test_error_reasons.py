"""A typed refusal survives the wire by its ErrorInfo reason, never by its message's wording."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2

from engine_service.api import errors as e
from engine_service.serving.errors import error_for


def info(reason: str, domain: str = e.ERROR_DOMAIN) -> error_details_pb2.ErrorInfo:
    return error_details_pb2.ErrorInfo(reason=reason, domain=domain)


@pytest.mark.parametrize("message", ["json_schema: bad", "reworded entirely"])
def test_an_invalid_json_schema_comes_back_as_its_type_whatever_the_message(message: str) -> None:
    error = error_for(grpc.StatusCode.INVALID_ARGUMENT, message, info(e.ErrorReason.INVALID_JSON_SCHEMA))
    assert type(error) is e.InvalidJsonSchema and str(error) == message


@pytest.mark.parametrize(
    "detail",
    [None, info(e.ErrorReason.INVALID_JSON_SCHEMA, domain="another.domain"), info("NOT_A_REASON")],
)
def test_without_forklines_reason_it_is_a_plain_invalid_argument(detail) -> None:
    # negative control: the message alone (even one naming json_schema) never makes the typed refusal
    error = error_for(grpc.StatusCode.INVALID_ARGUMENT, "json_schema: bad", detail)
    assert type(error) is e.InvalidArgument


def test_the_reason_under_another_code_stays_in_that_codes_category() -> None:
    error = error_for(grpc.StatusCode.NOT_FOUND, "x", info(e.ErrorReason.INVALID_JSON_SCHEMA))
    assert type(error) is e.NotFound
