"""Logging set-up: secrets redacted, JSON for every line (the standard library's included), the
request id on the lines of its request."""

from __future__ import annotations

import json
import logging

import pytest
import structlog

from services.common.logging import (
    REQUEST_ID_HEADER,
    bound_request_id,
    configure_logging,
    redact,
    request_headers,
    request_id_from,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nats://alice:s3cret@10.0.0.1:4222", "nats://alice:***@10.0.0.1:4222"),
        ("connect to tls://tok3n@nats:4222 now", "connect to tls://***@nats:4222 now"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("mail a@b.c", "mail a@b.c"),
    ],
)
def test_redact_hides_url_passwords_and_tokens(text, expected):
    assert redact(text) == expected


def test_json_lines_for_structlog_and_stdlib_with_request_id_and_redaction(restore_logging, capsys):
    configure_logging("info", "json")
    with bound_request_id("req-42"):
        structlog.get_logger("test").info("thing.happened", url="nats://u:pw@h:1")
        logging.getLogger("uvicorn.access").info('127.0.0.1 - "POST /generate HTTP/1.1" 200')
    structlog.get_logger("test").info("outside")
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in (captured.out + captured.err).splitlines() if line.strip()]
    by_event = {line["event"]: line for line in lines}
    assert by_event["thing.happened"]["request_id"] == "req-42"
    assert by_event["thing.happened"]["url"] == "nats://u:***@h:1"
    access = next(line for line in lines if "POST /generate" in line["event"])
    assert access["request_id"] == "req-42" and access["logger"] == "uvicorn.access"
    assert "request_id" not in by_event["outside"]


def test_unknown_log_format_is_refused(restore_logging):
    with pytest.raises(ValueError, match="log format"):
        configure_logging("info", "xml")


def test_request_id_travels_in_one_header():
    assert request_headers("abc") == {REQUEST_ID_HEADER: "abc"}
    assert request_headers("") is None
    assert request_id_from(request_headers("abc")) == "abc"
    assert request_id_from(None) is None


async def test_with_progress_reports_start_running_and_done(restore_logging, capsys):
    import asyncio

    from services.common.logging import with_progress

    configure_logging("info", "json")
    assert await with_progress("thing.load", asyncio.sleep(0.25, result=42), every_s=0.1, model="m") == 42
    captured = capsys.readouterr()
    events = [json.loads(line) for line in captured.out.splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    assert names[0] == "thing.load.started" and names[-1] == "thing.load.done"
    assert "thing.load.running" in names and all(e["model"] == "m" for e in events)
    assert events[-1]["seconds"] >= 0.25


async def test_with_progress_says_when_its_work_is_abandoned(restore_logging, capsys):
    import asyncio

    from services.common.logging import with_progress

    configure_logging("info", "json")
    work = asyncio.ensure_future(asyncio.Event().wait())
    progress = asyncio.ensure_future(with_progress("thing.load", work, every_s=10.0))
    await asyncio.sleep(0.05)
    progress.cancel()
    with pytest.raises(asyncio.CancelledError):
        await progress
    names = [json.loads(line)["event"] for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert names == ["thing.load.started", "thing.load.abandoned"]
    assert work.cancelled()
