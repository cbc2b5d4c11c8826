"""The byte-level half of `nats_reader.NatsReader`: `ReadProtocol`, the
`asyncio.BufferedProtocol` that parses the server's stream (MSG/HMSG, PING/PONG, INFO, +OK/-ERR)
and reads each payload into the place its subscription's `PayloadSink` chose, and what it hands
over (`Delivery`, the parsed headers) or raises (`ReaderError`). Apart from `nats_reader.py`,
which owns the connection around it: servers, TLS, auth, subscriptions, keepalive and reconnects
(the protocol reports INFO, server errors and a lost connection back to it).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import structlog

if TYPE_CHECKING:
    from services.common.nats_reader import NatsReader

log = structlog.get_logger(__name__)

CRLF = b"\r\n"
CONTROL_BUFFER_BYTES = 64 * 1024  # control lines and small payloads; grows for a larger header block
MAX_CONTROL_LINE_BYTES = 1024 * 1024  # an INFO with a long server list fits; more is a protocol error


class ReaderError(Exception):
    """The server refused the connection (auth, protocol) or did not answer in time."""


@dataclass(frozen=True)
class Delivery:
    """Where a message came from: what a handler needs to answer it or to ack it."""

    subject: str
    reply: str | None = None
    headers: dict[str, str] | None = None
    missed: int = 0  # messages from this message's sender to this subject lost right before it


class PayloadSink(Protocol):
    """A subscription's side of the reader: it chooses where each payload lands, then gets it."""

    def target(self, delivery: Delivery, size: int) -> memoryview:
        """A writable byte view of exactly `size` bytes for this message's payload."""
        ...

    def landed(self, delivery: Delivery, payload: memoryview) -> None:
        """The payload is complete in the view `target` returned."""
        ...


def parse_headers(block: bytes) -> dict[str, str]:
    """A NATS header block (`NATS/1.0[ status]\\r\\nKey: Value\\r\\n...\\r\\n`) -> {key: value}.
    A repeated key keeps its last value, as nats-py's dict does."""
    headers: dict[str, str] = {}
    for line in block.decode(errors="replace").split("\r\n")[1:]:
        key, sep, value = line.partition(":")
        if sep:
            headers[key.strip()] = value.strip()
    return headers


@dataclass
class _Incoming:
    """One MSG/HMSG whose header block, payload or trailing CRLF has not all arrived yet."""

    sid: int
    subject: str
    reply: str | None
    header_bytes: int
    payload_bytes: int
    delivery: Delivery | None = None
    sink: PayloadSink | None = None
    target: memoryview | None = None
    filled: int = 0


class ReadProtocol(asyncio.BufferedProtocol):
    """Parses the server's byte stream. Bytes [start, end) of `buffer` are read but not parsed."""

    def __init__(self, reader: NatsReader) -> None:
        self._reader = reader
        self.transport: asyncio.Transport | None = None  # asyncio's or uvloop's (not a subclass)
        self.buffer = bytearray(CONTROL_BUFFER_BYTES)
        self.start = 0
        self.end = 0
        self.incoming: _Incoming | None = None
        self._into_target = False
        self.info: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pongs: list[asyncio.Future[None]] = []
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        incoming = self.incoming
        if (
            incoming is not None
            and incoming.target is not None
            and self.start == self.end
            and incoming.filled < incoming.payload_bytes
        ):
            self._into_target = True  # straight from the socket into the payload's final place
            return incoming.target[incoming.filled :]
        self._into_target = False
        if self.start == self.end:
            self.start = self.end = 0  # nothing unparsed: read into the whole buffer again
        elif self.end == len(self.buffer):
            self._make_room()
        return memoryview(self.buffer)[self.end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_target:
            assert self.incoming is not None
            self.incoming.filled += nbytes
        else:
            self.end += nbytes
        try:
            self._parse()
        except Exception as exc:  # a protocol violation: drop the connection, the reader reconnects
            log.error("nats_reader.protocol_error", error=repr(exc))
            if self.transport is not None:
                self.transport.abort()

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        for future in [self.info, *self.pongs, self.closed]:
            if not future.done():
                if future is self.closed:
                    future.set_result(None)
                else:
                    future.set_exception(ConnectionError(f"connection to the NATS server lost: {exc!r}"))
        self.pongs.clear()
        self._reader._on_connection_lost(self, exc)

    # writing

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def ping(self) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pongs.append(future)
        self.write(b"PING\r\n")
        return future

    # parsing

    def _make_room(self) -> None:
        """Move the unparsed bytes to the front; grow when they fill the whole buffer."""
        pending = self.end - self.start
        if self.start > 0:
            self.buffer[:pending] = self.buffer[self.start : self.end]
            self.start, self.end = 0, pending
        if self.end == len(self.buffer):
            if len(self.buffer) >= MAX_CONTROL_LINE_BYTES + CONTROL_BUFFER_BYTES:
                raise ReaderError(f"control line or header block over {MAX_CONTROL_LINE_BYTES} bytes")
            self.buffer.extend(bytes(len(self.buffer)))

    def _parse(self) -> None:
        while True:
            if self.incoming is not None:
                if not self._continue_incoming(self.incoming):
                    return
                continue
            eol = self.buffer.find(CRLF, self.start, self.end)
            if eol < 0:
                if self.end - self.start > MAX_CONTROL_LINE_BYTES:
                    raise ReaderError("control line too long")
                return
            line = bytes(self.buffer[self.start : eol])
            self.start = eol + len(CRLF)
            self._on_line(line)

    def _on_line(self, line: bytes) -> None:
        op, _, rest = line.partition(b" ")
        op = op.upper()
        if op == b"MSG":  # MSG <subject> <sid> [reply] <#bytes>
            args = rest.split()
            reply = args[2].decode() if len(args) == 4 else None
            self.incoming = _Incoming(int(args[1]), args[0].decode(), reply, 0, int(args[-1]))
        elif op == b"HMSG":  # HMSG <subject> <sid> [reply] <#header bytes> <#total bytes>
            args = rest.split()
            reply = args[2].decode() if len(args) == 5 else None
            header_bytes, total = int(args[-2]), int(args[-1])
            self.incoming = _Incoming(int(args[1]), args[0].decode(), reply, header_bytes, total - header_bytes)
        elif op == b"PING":
            self.write(b"PONG\r\n")
        elif op == b"PONG":
            if self.pongs:
                future = self.pongs.pop(0)
                if not future.done():
                    future.set_result(None)
        elif op == b"INFO":
            info = json.loads(rest)
            if not self.info.done():
                self.info.set_result(info)
            self._reader._on_info(info)
        elif op == b"-ERR":
            self._reader._on_server_error(rest.decode(errors="replace").strip().strip("'"))
            error = ReaderError(f"NATS server error: {rest.decode(errors='replace')}")
            for future in [self.info, *self.pongs]:
                if not future.done():
                    future.set_exception(error)
            self.pongs.clear()
        elif op != b"+OK":
            raise ReaderError(f"unexpected protocol line {line[:80]!r}")

    def _continue_incoming(self, incoming: _Incoming) -> bool:
        """Advance the message in progress with what is in the buffer; True once it is done."""
        if incoming.target is None:  # its header block first, so the sink can pick the place
            if self.end - self.start < incoming.header_bytes:
                if incoming.header_bytes > len(self.buffer) - self.start:
                    self._make_room()
                return False
            headers = None
            if incoming.header_bytes:
                headers = parse_headers(bytes(self.buffer[self.start : self.start + incoming.header_bytes]))
                self.start += incoming.header_bytes
            incoming.delivery = Delivery(incoming.subject, incoming.reply, headers)
            incoming.sink = self._reader._sink(incoming.sid)
            size = incoming.payload_bytes
            target = _sink_target(incoming.sink, incoming.delivery, size) if incoming.sink else None
            if target is None or len(target) != size:  # no sink (a late message after unsubscribe) or it failed
                incoming.sink, target = None, memoryview(bytearray(size))
            incoming.target = target
        if incoming.filled < incoming.payload_bytes:
            take = min(self.end - self.start, incoming.payload_bytes - incoming.filled)
            incoming.target[incoming.filled : incoming.filled + take] = self.buffer[self.start : self.start + take]
            incoming.filled += take
            self.start += take
            if incoming.filled < incoming.payload_bytes:
                return False
        if self.end - self.start < len(CRLF):
            return False
        if self.buffer[self.start : self.start + len(CRLF)] != CRLF:
            raise ReaderError(f"payload of {incoming.subject} not followed by CRLF")
        self.start += len(CRLF)
        self.incoming = None
        if incoming.sink is not None and incoming.delivery is not None:
            _sink_landed(incoming.sink, incoming.delivery, incoming.target)
        return True


# A sink's failure is one message's problem: it is logged and the message dropped, while the
# connection (every other subscription's messages) stays up. Only protocol errors drop it.


def _sink_target(sink: PayloadSink, delivery: Delivery, size: int) -> memoryview | None:
    try:
        return sink.target(delivery, size)
    except Exception:
        log.exception("nats_reader.sink_failed", subject=delivery.subject, size=size)
        return None


def _sink_landed(sink: PayloadSink, delivery: Delivery, payload: memoryview) -> None:
    try:
        sink.landed(delivery, payload)
    except Exception:
        log.exception("nats_reader.sink_failed", subject=delivery.subject, size=len(payload))
