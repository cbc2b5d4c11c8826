"""The error body every route answers with (OpenAI's shape, `native.error_body`), as the OpenAPI
schema documents it: without this, Litestar documents its own 400 body, which we never send."""

from __future__ import annotations

import msgspec
from litestar.openapi.datastructures import ResponseSpec


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int | None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


ERROR_STATUSES = {
    400: "invalid input; `error.param` names the field",
    413: "the body is over the size limit",
    415: "the body is not JSON",
    503: "no scheduler or detokenizer can take the request now",
}
ERROR_RESPONSES = {
    status: ResponseSpec(data_container=ErrorBody, description=description, generate_examples=False)
    for status, description in ERROR_STATUSES.items()
}
