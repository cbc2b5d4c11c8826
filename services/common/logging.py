"""Logging of every process: structlog for our lines, the standard library's (uvicorn, nats-py)
rendered by the same processors, console or JSON, secrets redacted.

Request ids: the tokenizer binds `request_id` in structlog's contextvars for the life of an HTTP
request and sends it to the other services in the `Sw-Request-Id` NATS header; they bind it
while they handle that message (`bound_request_id`), so every line about one request carries
the same id in all three services.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Iterator, Mapping
from typing import Any, TypeVar

import structlog

T = TypeVar("T")
REQUEST_ID_HEADER = "Sw-Request-Id"  # NATS header: the request id of the message's request
LOG_FORMATS = ("console", "json")
# `scheme://userinfo@host`: NATS URLs carry `user:password` or a bare token there.
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@", re.IGNORECASE)
REDACTED = "***"


def _redacted_userinfo(match: re.Match[str]) -> str:
    user, colon, _secret = match.group("userinfo").partition(":")
    return match.group("scheme") + (f"{user}:{REDACTED}" if colon else REDACTED) + "@"


def redact(text: str) -> str:
    """`nats://user:secret@host` -> `nats://user:***@host`, `nats://token@host` ->
    `nats://***@host`; other text unchanged."""
    return _URL_USERINFO.sub(_redacted_userinfo, text) if "@" in text else text


def redact_secrets(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: passwords in URLs are redacted in every string value."""
    return {key: redact(value) if isinstance(value, str) else value for key, value in event.items()}


def _shared_processors() -> list[Any]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
        structlog.processors.format_exc_info,
        redact_secrets,
    ]


def _renderer(fmt: str) -> Any:
    return structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)


def add_logging_arguments(parser: argparse.ArgumentParser, level: str, fmt: str) -> None:
    """`--log-level` and `--log-format` of every service, defaulting to the environment's values."""
    parser.add_argument("--log-level", default=level, help="debug, info, warning or error")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=fmt, help="console lines or one JSON object per line")


def configure_logging(level: str = "info", fmt: str = "console") -> None:
    """Once per process. Standard-library records (uvicorn's access and error lines included)
    go through the same processors, so `fmt="json"` makes every line of the process JSON."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(LOG_FORMATS)}")
    numeric = logging.getLevelName(level.upper())
    handler = logging.StreamHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *_shared_processors()],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, _renderer(fmt)],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)  # propagate to ours instead of uvicorn's own handlers
        logger.handlers[:], logger.propagate, logger.disabled = [], True, False
        logger.setLevel(logging.NOTSET)
    structlog.configure(
        processors=[*_shared_processors(), _renderer(fmt)],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=True,
    )


def request_id_from(headers: Mapping[str, str] | None) -> str | None:
    return headers.get(REQUEST_ID_HEADER) if headers else None


def request_headers(request_id: str | None) -> dict[str, str] | None:
    """The NATS headers that carry `request_id` (None: no headers at all)."""
    return {REQUEST_ID_HEADER: request_id} if request_id else None


@contextlib.contextmanager
def bound_request_id(request_id: str | None) -> Iterator[None]:
    """Every structlog line inside the block carries `request_id` (nothing when None)."""
    if not request_id:
        yield
        return
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        yield


async def with_progress(event: str, work: Awaitable[T], every_s: float = 10.0, **fields: Any) -> T:
    """Await `work` (e.g. a model load and graph capture in a thread) with a line when it starts,
    one every `every_s` while it runs, and one with its duration when it is done (or abandoned:
    cancelled, which cancels `work` too)."""
    log = structlog.get_logger("sparkwire.progress")
    started = time.monotonic()
    log.info(f"{event}.started", **fields)
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=every_s)
            if not task.done():
                log.info(f"{event}.running", seconds=round(time.monotonic() - started), **fields)
    except asyncio.CancelledError:  # a stop during the work: it is abandoned, and says so
        task.cancel()
        log.info(f"{event}.abandoned", seconds=round(time.monotonic() - started, 2), **fields)
        raise
    result = task.result()
    log.info(f"{event}.done", seconds=round(time.monotonic() - started, 2), **fields)
    return result
