"""`InvalidRequest`: a body refused before it reaches NATS, which the HTTP layer answers with an
OpenAI-style 400 naming the field (`param`). Every check module raises it through `require`."""

from __future__ import annotations


class InvalidRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def require(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise InvalidRequest(message, param)
