"""A message as several buffers: encoded without copying its large bytes field, and published
through nats-py without copying any of its buffers.

Why: a pushed weight piece is ~8 MiB of tensor bytes behind a ~100-byte header. msgspec copies a
bytes field into its output, and nats-py builds each publish as one bytes object (`HPUB` line +
header block + payload + CRLF, the payload copied three times); on a CPU bound machine those copies
were most of a push. Here the tensor bytes stay where they are until the event loop writes them
(uvloop: one writev of every part; asyncio's selector loop joins the parts once).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import msgspec
from nats import errors
from nats.aio.client import Client

Buffer = Union[bytes, bytearray, memoryview]
NATS_HEADER_LINE = b"NATS/1.0\r\n"
CRLF = b"\r\n"
EMPTY_BIN = b"\xc4\x00"  # msgpack bin 8 of length 0


def encode_parts(encoder: msgspec.msgpack.Encoder, message: msgspec.Struct) -> list[Buffer]:
    """`encoder.encode(message)` as [head, the last field's bytes]: the same bytes, the last
    field (bytes-like, encoded last) not copied. Raises TypeError for a message whose last field
    is not bytes-like or is omitted when empty."""
    last = message.__struct_fields__[-1]
    data = memoryview(getattr(message, last)).cast("B")
    head = encoder.encode(msgspec.structs.replace(message, **{last: b""}))
    if not head.endswith(EMPTY_BIN):
        raise TypeError(f"{type(message).__name__}.{last} is not encoded last as bytes")
    return [head[: -len(EMPTY_BIN)] + _bin_header(data.nbytes), data]


def _bin_header(size: int) -> bytes:
    """msgpack's shortest bin header for `size` bytes (bin 8, 16 or 32), as msgspec writes it."""
    for marker, width in ((b"\xc4", 1), (b"\xc5", 2), (b"\xc6", 4)):
        if size < 1 << (8 * width):
            return marker + size.to_bytes(width, "big")
    raise ValueError(f"{size} bytes: over msgpack's 4 GiB bin limit")


def byte_range(parts: list[memoryview], start: int, end: int) -> list[memoryview]:
    """Bytes [start, end) of the concatenation of `parts` (byte views), as views into them."""
    views, offset = [], 0
    for part in parts:
        low, high = max(start - offset, 0), min(end - offset, len(part))
        if low < high:
            views.append(part[low:high])
        offset += len(part)
    return views


def header_block(headers: dict[str, str]) -> bytes:
    """The NATS header block: `NATS/1.0\\r\\n` + `Key: Value\\r\\n`... + `\\r\\n` (as nats-py writes it)."""
    if any(c in key + value for key, value in headers.items() for c in "\r\n"):
        raise ValueError("a NATS header key or value with a line break")
    lines = b"".join(f"{key}: {value}".encode() + CRLF for key, value in headers.items())
    return NATS_HEADER_LINE + lines + CRLF


async def publish_parts(nc: Client, subject: str, headers: dict[str, str], parts: Sequence[Buffer]) -> None:
    """`nc.publish(subject, b"".join(parts), headers=headers)` without its copies: the command
    goes to nats-py's pending writes as its parts, in one step (no other command between them).
    Checks what `publish` checks. Relies on nats-py's `_pending` list, written by its flusher with
    `transport.writelines` (tests/services/common/test_scatter.py holds it to that)."""
    if nc.is_closed:
        raise errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise errors.ConnectionDrainingError
    size = sum(memoryview(part).nbytes for part in parts)
    if size > nc.max_payload:
        raise errors.MaxPayloadError
    if not nc.is_connected and size + nc._pending_data_size > nc._max_pending_size:
        raise errors.OutboundBufferLimitError
    block = header_block(headers)
    command = [f"HPUB {subject} {len(block)} {len(block) + size}\r\n".encode() + block, *parts, CRLF]
    nc._pending.extend(command)
    nc._pending_data_size += len(command[0]) + size + len(CRLF)
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += size
    if nc._max_pending_size > 0 and nc._pending_data_size > nc._max_pending_size:
        await nc._flush_pending(force_flush=True)  # what nats-py's `_send_command` does: written before more piles up
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()
