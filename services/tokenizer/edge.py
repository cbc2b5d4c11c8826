"""The ASGI layer around the Litestar app: what every HTTP request goes through, 404s included.

In order: the request id (`X-Request-Id` in, or a new one; bound to every log line of the call
and returned in the `X-Request-Id` response header), the API key (`Authorization: Bearer`,
every route but /health, and /metrics unless `protect_metrics`), then HTTP metrics labelled by
route, never by raw path.
"""

from __future__ import annotations

import hmac
import re
import time
from collections.abc import Collection
from typing import Any

import structlog
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from services.common.logging import bound_request_id
from services.tokenizer.json_body import encode_json
from services.tokenizer.metrics import UNMATCHED_ROUTE, Metrics
from services.tokenizer.native import error_body
from services.tokenizer.validation import new_request_id

log = structlog.get_logger(__name__)

REQUEST_ID_SCOPE_KEY = "sparkwire.request_id"
# What a client may send as X-Request-Id: it becomes part of NATS message fields and log lines.
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ALWAYS_OPEN = frozenset({"/health"})


def request_id_of(request: Any) -> str:
    """The id the edge gave this HTTP request (handlers get it through their `Request`)."""
    return request.scope.get(REQUEST_ID_SCOPE_KEY) or new_request_id()


def _header(scope: Scope, name: bytes) -> str | None:
    value = next((v for k, v in scope.get("headers", []) if k.lower() == name), None)
    return None if value is None else value.decode("latin-1")


class HttpEdge:
    def __init__(
        self, app: ASGIApp, metrics: Metrics, routes: Collection[str], api_key: str | None = None,
        protect_metrics: bool = False,
    ) -> None:  # fmt: skip
        self._app = app
        self._metrics = metrics
        self._routes = frozenset(routes)
        self._api_key = api_key or None
        self._open = ALWAYS_OPEN if protect_metrics else ALWAYS_OPEN | {"/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        request_id = given if given is not None and CLIENT_REQUEST_ID.fullmatch(given) else new_request_id()
        scope[REQUEST_ID_SCOPE_KEY] = request_id  # type: ignore[literal-required]
        with bound_request_id(request_id):
            await self._serve(scope, receive, self._observing(scope, send, request_id), given, request_id)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, given: str | None, request_id: str) -> None:
        if given is not None and given != request_id:
            message = "must be 1 to 128 characters of letters, digits and ._:-"
            await _send_error(send, 400, error_body(f"X-Request-Id: {message}", "invalid_request_error", None, "X-Request-Id"))
        elif not self._authorized(scope):
            await _send_error(send, 401, _unauthorized())
        else:
            await self._app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        if self._api_key is None or scope["path"] in self._open:
            return True
        presented = _header(scope, b"authorization") or ""
        scheme, _, token = presented.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._api_key.encode())

    def _observing(self, scope: Scope, send: Send, request_id: str) -> Send:
        started = time.perf_counter()
        route = scope["path"] if scope["path"] in self._routes else UNMATCHED_ROUTE

        async def send_and_count(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}  # type: ignore[assignment]
                self._metrics.observe_http(route, scope["method"], message["status"], time.perf_counter() - started)
            await send(message)

        return send_and_count


def _unauthorized() -> dict[str, Any]:
    body = error_body("invalid or missing API key: send `Authorization: Bearer <key>`", "invalid_request_error", None)
    body["error"]["code"] = "invalid_api_key"
    return body


async def _send_error(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = encode_json(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
