"""Publish a recording back to NATS, in order, with its headers, fast or with original timing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.client import Client

from services.common.connection import NatsConnection, as_connection, nats_py_options
from services.recorder.format import RecordedMessage, iter_messages, read_header

FLUSH_EVERY_BYTES = 4 * 1024 * 1024  # wait for the server between bursts (flow control)


class ReplayError(Exception):
    """A recorded message cannot be published to this server (e.g. larger than its max_payload)."""


@dataclass
class ReplayStats:
    num_messages: int = 0
    num_bytes: int = 0
    num_skipped: int = 0  # filtered out by `only_subject`


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` is one token, a final `>` one or more tokens."""
    wanted, tokens = pattern.split("."), subject.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > index
        if index >= len(tokens) or token not in ("*", tokens[index]):
            return False
    return len(tokens) == len(wanted)


async def replay(
    nats_url: NatsConnection | str,
    path: Path | str,
    timing: str = "fast",
    only_subject: str | None = None,
    on_progress: Callable[[ReplayStats], None] | None = None,
) -> ReplayStats:
    if timing not in ("fast", "original"):
        raise ValueError(f"timing must be 'fast' or 'original', not {timing!r}")
    connection = as_connection(nats_url)
    nc = await nats.connect(name="sparkwire-replay", **nats_py_options(connection))
    try:
        stats = await _publish_all(nc, path, timing == "original", only_subject, on_progress)
        await nc.flush()
        return stats
    finally:
        await nc.close()


async def _publish_all(
    nc: Client,
    path: Path | str,
    original_timing: bool,
    only_subject: str | None,
    on_progress: Callable[[ReplayStats], None] | None,
) -> ReplayStats:
    stats, clock, unflushed = ReplayStats(), _Clock(original_timing), 0
    with open(path, "rb") as stream:
        read_header(stream)
        for message in iter_messages(stream):
            if only_subject is not None and not subject_matches(only_subject, message.subject):
                stats.num_skipped += 1
                continue
            await clock.wait_until(message.received_at)
            await _publish(nc, message)
            stats.num_messages += 1
            stats.num_bytes += len(message.data)
            unflushed += len(message.data)
            if unflushed >= FLUSH_EVERY_BYTES:
                await nc.flush()
                unflushed = 0
            if on_progress is not None:
                on_progress(stats)
    return stats


async def _publish(nc: Client, message: RecordedMessage) -> None:
    size = len(message.data) + _header_block_size(message.headers)
    if size > nc.max_payload:
        raise ReplayError(
            f"{message.subject}: {size} bytes exceed this server's max_payload {nc.max_payload}; "
            "replay into a server with at least the recording server's limit"
        )
    # A recorded request gets a fresh inbox nobody listens on: responders answer into the void.
    reply = f"_INBOX.sparkwire-replay.{uuid.uuid4().hex}" if message.reply else ""
    await nc.publish(message.subject, message.data, reply=reply, headers=message.headers or None)


def _header_block_size(headers: dict[str, str] | None) -> int:
    """What the server counts for headers: `NATS/1.0\r\n`, `Key: Value\r\n` lines, `\r\n`."""
    if not headers:
        return 0
    return 12 + sum(len(key.encode()) + len(value.encode()) + 4 for key, value in headers.items())


class _Clock:
    """Original timing: message i goes out (received_at[i] - received_at[0]) after the first."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._origin: tuple[float, float] | None = None  # (recorded time, loop time) of message 0

    async def wait_until(self, recorded_at: float) -> None:
        if not self._enabled:
            return
        loop = asyncio.get_running_loop()
        if self._origin is None:
            self._origin = (recorded_at, loop.time())
        delay = self._origin[1] + (recorded_at - self._origin[0]) - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
