"""NATS transport shared by the three services: typed publish/subscribe, chunking, flow control.

- `publish` never sends a message larger than the server's `max_payload` *including headers*:
  a larger payload is split into chunks (headers `Sw-Msg`, `Sw-Chunk: i/n`) and reassembled by
  `subscribe` on the other side. Chunked messages are only allowed on direct subjects (one
  subscriber), see `contracts.subjects`.
- Each subscription hands decoded messages to its handler from its own task, in arrival order,
  so a slow handler never blocks the client's read loop (which is what trips slow-consumer
  limits).
- `close` drains (flushes pending publishes, finishes handlers) before closing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import nats
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

log = structlog.get_logger(__name__)

T = TypeVar("T")
Handler = Callable[[T, Msg], Awaitable[None]]

MSG_HEADER = "Sw-Msg"
CHUNK_HEADER = "Sw-Chunk"
HEADER_MARGIN = 256  # bytes kept free for the NATS header block framing


class PayloadTooLarge(Exception):
    """A message that must travel in one piece (a request) exceeds `max_payload`."""


class Transport:
    """One NATS connection owned by one service instance."""

    def __init__(self, nc: Client, name: str) -> None:
        self._nc = nc
        self._name = name
        self._sender_id = uuid.uuid4().hex[:12]
        self._seq = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Any] = []

    @classmethod
    async def connect(cls, url: str, name: str) -> Transport:
        async def on_error(exc: Exception) -> None:
            log.warning("nats.error", service=name, error=repr(exc))

        async def on_disconnect() -> None:
            log.warning("nats.disconnected", service=name)

        async def on_reconnect() -> None:
            log.info("nats.reconnected", service=name)

        nc = await nats.connect(
            servers=[url],
            name=name,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
        )
        return cls(nc, name)

    @property
    def max_payload(self) -> int:
        return self._nc.max_payload

    @property
    def is_connected(self) -> bool:
        return self._nc.is_connected

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    async def publish(self, subject: str, message: msgspec.Struct | bytes) -> None:
        payload = message if isinstance(message, bytes) else self.encode(message)
        limit = self.max_payload - HEADER_MARGIN
        if len(payload) <= limit:
            await self._nc.publish(subject, payload)
            return
        msg_id = f"{self._sender_id}-{next(self._seq)}"
        view = memoryview(payload)
        num_chunks = -(-len(payload) // limit)
        for index in range(num_chunks):
            headers = {MSG_HEADER: msg_id, CHUNK_HEADER: f"{index}/{num_chunks}"}
            await self._nc.publish(subject, bytes(view[index * limit : (index + 1) * limit]), headers=headers)

    async def request(
        self, subject: str, message: msgspec.Struct, reply_type: type[T], timeout: float
    ) -> T:
        """Single-message request/reply. Raises `nats.errors.NoRespondersError` at once when
        nobody listens, `nats.errors.TimeoutError` after `timeout`."""
        payload = self.encode(message)
        if len(payload) > self.max_payload - HEADER_MARGIN:
            raise PayloadTooLarge(f"{subject}: {len(payload)} bytes > max_payload {self.max_payload}")
        reply = await self._nc.request(subject, payload, timeout=timeout)
        return msgspec.msgpack.decode(reply.data, type=reply_type)

    async def respond(self, msg: Msg, message: msgspec.Struct) -> None:
        await msg.respond(self.encode(message))

    async def subscribe(
        self, subject: str, message_type: type[T], handler: Handler[T], queue: str = ""
    ) -> None:
        """Decode every message on `subject` as `message_type` and await `handler` on it, in order."""
        inbox: asyncio.Queue[Msg] = asyncio.Queue()

        async def enqueue(msg: Msg) -> None:
            inbox.put_nowait(msg)

        sub = await self._nc.subscribe(
            subject, queue=queue, cb=enqueue, pending_msgs_limit=-1, pending_bytes_limit=-1
        )
        self._subs.append(sub)
        decoder = msgspec.msgpack.Decoder(message_type)
        self._tasks.append(asyncio.create_task(_dispatch(inbox, decoder, handler, subject)))

    async def close(self) -> None:
        """Drain: stop receiving, let handlers finish what arrived, flush publishes, close."""
        with contextlib.suppress(Exception):
            await self._nc.drain()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if not self._nc.is_closed:
            await self._nc.close()


@dataclass
class _Reassembly:
    chunks: list[bytes] = field(default_factory=list)
    expected: int = 0


async def _dispatch(
    inbox: asyncio.Queue[Msg], decoder: msgspec.msgpack.Decoder, handler: Handler[Any], subject: str
) -> None:
    partial: dict[str, _Reassembly] = {}
    while True:
        msg = await inbox.get()
        payload = _reassemble(msg, partial)
        if payload is None:
            continue
        try:
            message = decoder.decode(payload)
        except msgspec.DecodeError as exc:
            log.error("transport.bad_message", subject=subject, error=str(exc))
            continue
        try:
            await handler(message, msg)
        except Exception:
            log.exception("transport.handler_failed", subject=subject)


def _reassemble(msg: Msg, partial: dict[str, _Reassembly]) -> bytes | None:
    headers = msg.headers or {}
    msg_id = headers.get(MSG_HEADER)
    if msg_id is None:
        return msg.data
    index, total = (int(part) for part in headers[CHUNK_HEADER].split("/"))
    state = partial.setdefault(msg_id, _Reassembly(expected=total))
    if index != len(state.chunks):
        log.error("transport.chunk_out_of_order", msg_id=msg_id, index=index, have=len(state.chunks))
        del partial[msg_id]
        return None
    state.chunks.append(msg.data)
    if len(state.chunks) < state.expected:
        return None
    del partial[msg_id]
    return b"".join(state.chunks)
