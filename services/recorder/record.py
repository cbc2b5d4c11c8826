"""Record every raw NATS message on a subject pattern to a recording file."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from services.common.connection import NatsConnection, as_connection
from services.common.nats_start import connect_nats_py
from services.recorder.format import FORMAT_VERSION, MAGIC, RecordedMessage, RecordingHeader, RecordingWriter


log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RecordStats:
    num_messages: int
    num_bytes: int


async def record(
    nats_url: NatsConnection | str,
    out: Path | str,
    subject: str = subjects.ALL,
    duration_s: float | None = None,
    stop: asyncio.Event | None = None,
    ready: asyncio.Event | None = None,
) -> RecordStats:
    """Record until `stop` is set or `duration_s` passes. `ready` is set once the subscription is
    live on the server, so a caller knows from when on nothing is missed."""
    connection = as_connection(nats_url)
    nc = await connect_nats_py(connection, "sparkwire-recorder", _log_error)
    try:
        with open(out, "wb") as stream:
            writer = RecordingWriter(stream, RecordingHeader(MAGIC, FORMAT_VERSION, time.time(), connection.redacted_url, subject))
            await _subscribe(nc, subject, writer)
            if ready is not None:
                ready.set()
            await _wait(stop or asyncio.Event(), duration_s)
            await nc.drain()  # hands the callback what already arrived, then closes
            return RecordStats(writer.num_messages, writer.num_bytes)
    finally:
        if not nc.is_closed:
            await nc.close()


async def _log_error(exc: Exception) -> None:
    log.warning("recorder.nats_error", error=repr(exc))


async def _subscribe(nc: Client, subject: str, writer: RecordingWriter) -> None:
    async def on_message(msg: Msg) -> None:
        writer.write(RecordedMessage(msg.subject, msg.headers, time.time(), msg.data, msg.reply or ""))

    # No queue group and no pending limits: the recorder must see every message, and dropping
    # some as a "slow consumer" would make the recording silently wrong.
    await nc.subscribe(subject, cb=on_message, pending_msgs_limit=-1, pending_bytes_limit=-1)
    await nc.flush()  # the server now has the subscription: nothing published after this is missed


async def _wait(stop: asyncio.Event, duration_s: float | None) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), duration_s)
