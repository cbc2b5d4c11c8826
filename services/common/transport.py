"""NATS transport shared by the three services: typed publish/subscribe, chunking, flow control.

- Size. The server counts headers + payload against `max_payload` (nats-py checks only the
  payload). A payload of `FRAMED_MIN_BYTES` or more travels *framed*: split into chunks, each
  with headers `Sw-Msg` (message id), `Sw-Chunk` (`i/n`, fixed width) and `Sw-Ack` (the sender's
  ack inbox), sized so that the encoded header block + chunk is at most `max_payload`, exactly.
  `subscribe` reassembles them. Framed messages are only for direct subjects (one subscriber),
  see `contracts.subjects`. Requests travel in one message: too large raises `PayloadTooLarge`
  at once, never a timeout.
- Flow control. The receiver acks every chunk once it has taken it off its inbox (the last
  chunk of a message only after the handler returned). The sender keeps at most `window_bytes`
  of unacked chunks in flight per destination subject, so a burst of large messages never
  piles up in the server's per-connection buffer (`max_pending`, slow-consumer disconnect) or in
  the receiver's memory — also when the receiver's event loop is busy. Acks are per chunk, not
  per message, because one message (21 MB of prompt logprobs) can exceed `max_pending` alone.
  No ack progress for `ack_timeout_s` means the receiver is gone: `ReceiverGone` is raised.
  `settled(subject)` waits for every ack: the receiver handled all that was sent (an order
  across the connections of one sender, which NATS gives only within one connection).
- Order. Publishes to one subject leave in call order (a per-subject lock), and each
  subscription hands decoded messages to its handler from its own task, in arrival order, so a
  slow handler never blocks the client's read loop.
- Two connections. Publishing, requests and replies use nats-py; framed chunks reach its writer
  as views of the payload (`scatter.publish_parts`), and a payload given in parts (a weight
  piece's header and its tensor bytes) is never joined. Every subscription is read by
  `nats_reader.NatsReader`, which reads each payload from the socket straight into its final
  buffer (a chunk into its place in the reassembly buffer): nats-py's read path was the largest
  cost of a 21 MB message on the 2-core machine. All of one service's subscriptions share the
  reader, so one publisher's messages reach them in publish order, as on one connection.
- Gaps. Every published message carries `Sw-Seq: <sender> <n>`, numbered per (sender,
  destination subject). A receiver that sees a number skipped hands the next message over with
  `Delivery.missed` > 0, and when its reading connection had to reconnect (anything in flight to
  it may be lost) it calls the `on_receive_loss` listeners: the services fail the requests whose
  outputs may be gone, so a lost message never becomes a short answer presented as complete.
- Nothing from the wire is fatal. A malformed framing header, a chunk count or size over
  `max_message_bytes`, or reassemblies over `max_partial_bytes` per subscription: the chunk is
  read, logged with its subject and dropped (still acked), the connection stays up. A message
  that fails to decode (every field is bounded, see `contracts.limits`) is logged and dropped.
- Memory. A partial reassembly that gets no chunk for `reassembly_timeout_s` is dropped.
- `close` drains (flushes pending publishes, finishes handlers) before closing.

`Transport` and its API live here; the headers and the chunk plan in `framing.py`, the sender's
windows and gap marks in `send_windows.py`, each subscription's reassembly, acks and gap counts
in `receive.py`, the errors in `transport_errors.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import structlog
from nats.aio.client import Client

from services.common.connection import NatsConnection, as_connection
from services.common.framing import ACK_HEADER, SEQ_HEADER, BadFraming, chunk_headers, header_block_size, parse_framing, plan_chunks
from services.common.nats_reader import Delivery, NatsReader, ReaderError, ReaderEvents
from services.common.nats_start import auth_rejected, connect_nats_py, is_auth_rejection, unreachable
from services.common.natspy_reader import NatsPyReader
from services.common.receive import SubscriptionReceiver
from services.common.scatter import Buffer, byte_range, publish_parts
from services.common.send_windows import SendWindows, SendWindow
from services.common.transport_errors import PayloadTooLarge, ReceiverGone, TransportError

log = structlog.get_logger(__name__)

# Its errors are defined in transport_errors.py (the modules this one is built from raise them
# too), and imported from here.
__all__ = ["ConnectionEvents", "FRAMED_MIN_BYTES", "PayloadTooLarge", "ReceiverGone", "Traffic", "Transport", "TransportError"]

T = TypeVar("T")
Handler = Callable[[T, Delivery], Awaitable[None]]

FRAMED_MIN_BYTES = 256 * 1024  # from this size on, messages are framed and flow controlled
DEFAULT_WINDOW_BYTES = 32 * 1024 * 1024  # unacked bytes in flight per destination subject
DEFAULT_ACK_TIMEOUT_S = 10.0
DEFAULT_REASSEMBLY_TIMEOUT_S = 30.0
# The largest message a receiver reassembles: 128k prompt positions x top-20 as flat arrays are
# ~21 MB, the nested form about as much again, so 256 MiB leaves room without trusting a header.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_PARTIAL_BYTES = 1024 * 1024 * 1024  # all reassemblies in progress, per subscription


@dataclass
class Traffic:
    """Messages, chunks and payload bytes through one transport (for `sparkwire:nats_*` metrics).
    A whole message counts as one chunk; a framed one as its chunks."""

    messages_sent: int = 0
    chunks_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    chunks_received: int = 0
    bytes_received: int = 0


@dataclass
class ConnectionEvents:
    """What the NATS client reported on one connection (tests assert on these)."""

    traffic: Traffic = field(default_factory=Traffic)
    disconnects: int = 0
    reconnects: int = 0
    errors: list[str] = field(default_factory=list)
    # Called when the receiving connection came back after a disconnect: whatever was in
    # flight to this service meanwhile may be lost.
    loss_listeners: list[Callable[[], None]] = field(default_factory=list)
    # Called when the publishing connection came back: what it sent just before may be lost.
    send_loss_listeners: list[Callable[[], None]] = field(default_factory=list)


class Transport:
    """One NATS connection owned by one service instance."""

    def __init__(
        self,
        nc: Client,
        reader: NatsReader | NatsPyReader,
        name: str,
        events: ConnectionEvents | None = None,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
        reassembly_timeout_s: float = DEFAULT_REASSEMBLY_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_partial_bytes: int = DEFAULT_MAX_PARTIAL_BYTES,
    ) -> None:
        self._nc = nc
        self._reader = reader
        self._name = name
        self.events = events or ConnectionEvents()
        self._reassembly_timeout_s = reassembly_timeout_s
        self.max_message_bytes = max_message_bytes
        self.max_partial_bytes = max_partial_bytes
        self._receivers: list[SubscriptionReceiver] = []
        self.events.loss_listeners.append(self._forget_sequences)
        self.events.send_loss_listeners.append(self._mark_sequences_soon)
        self._sender_id = uuid.uuid4().hex[:12]
        self._seq = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._tasks: list[asyncio.Task[None]] = []
        self._send = SendWindows(nc, self._sender_id, window_bytes, ack_timeout_s)

    @classmethod
    async def connect(
        cls,
        connection: NatsConnection | str,
        name: str,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
        reassembly_timeout_s: float = DEFAULT_REASSEMBLY_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> Transport:
        """`connection`: servers, TLS and auth (a plain URL string is one server without either).
        Raises `NatsStartError` when the server rejects the credentials, or none can be reached
        within `nats_start_timeout_s` (services/common/nats_start.py); reconnects after that are unlimited."""
        connection = as_connection(connection)
        events = ConnectionEvents()
        nc = await connect_nats_py(connection, name, **_callbacks(name, events))  # bounded at start
        try:
            reader = await _open_reader(connection, name, _reader_events(events))
        except ReaderError as exc:  # nats-py just got in: the server went away, or refused only the reader
            await nc.close()
            raise auth_rejected(connection, name) if is_auth_rejection(exc) else unreachable(connection, name, str(exc)) from None
        except BaseException:
            await nc.close()
            raise
        return cls(nc, reader, name, events, window_bytes, ack_timeout_s, reassembly_timeout_s, max_message_bytes)

    @property
    def max_payload(self) -> int:
        return self._nc.max_payload

    @property
    def is_connected(self) -> bool:
        return self._nc.is_connected and self._reader.is_connected

    def encode(self, message: msgspec.Struct) -> bytearray:
        """`encode_into` a fresh bytearray: for multi-MB messages (logprob arrays) several times
        faster than `encode`, whose bytes result grows by reallocation."""
        buffer = bytearray()
        self._encoder.encode_into(message, buffer)
        return buffer

    async def publish(
        self, subject: str, message: msgspec.Struct | Buffer | list[Buffer], headers: dict[str, str] | None = None
    ) -> None:
        """Publish, framing and flow-controlling large payloads. Raises `ReceiverGone` when a
        framed message's receiver stopped acking for `ack_timeout_s`. `headers` (e.g. the
        request id) travel with the message, on every chunk of a framed one. A list is the
        payload in parts (`scatter.encode_parts`): they travel as they are, without a join."""
        if isinstance(message, msgspec.Struct):
            message = self.encode(message)
        parts = [memoryview(part).cast("B") for part in (message if isinstance(message, list) else [message])]
        size = sum(len(part) for part in parts)
        window = self._send.of(subject)
        flow_controlled = self._send.window_bytes > 0 and size >= FRAMED_MIN_BYTES
        async with window.lock:  # Sw-Seq numbers are taken in send order
            window.last_number, window.last_sent = next(window.seq), time.monotonic()
            extra = (headers or {}) | {SEQ_HEADER: f"{self._sender_id} {window.last_number}"}
            if flow_controlled or size + header_block_size(extra) > self.max_payload:
                await self._publish_framed(subject, parts, size, window, extra)
            else:
                await self._nc.publish(subject, b"".join(parts), headers=extra)
                self.events.traffic.chunks_sent += 1
            self.events.traffic.messages_sent += 1
            self.events.traffic.bytes_sent += size

    async def _publish_framed(
        self, subject: str, parts: list[memoryview], size: int, window: SendWindow, extra: dict[str, str]
    ) -> None:
        ack_subject = await self._send.ack_inbox() if self._send.window_bytes > 0 else None
        msg_id = f"{self._sender_id}-{next(self._seq)}"
        chunk_size, num_chunks, width = plan_chunks(size, self.max_payload, msg_id, ack_subject, extra)
        for index in range(num_chunks):
            chunk = byte_range(parts, index * chunk_size, (index + 1) * chunk_size)  # views: no copy
            if ack_subject is not None:
                await self._send.acquire(subject, window, f"{msg_id} {index}", sum(map(len, chunk)))
            headers = chunk_headers(msg_id, index, num_chunks, width, ack_subject, extra)
            await publish_parts(self._nc, subject, headers, chunk)
            self.events.traffic.chunks_sent += 1

    async def settled(self, subject: str) -> None:
        """Wait until the receiver of `subject` acked every framed message sent to it, i.e. handled
        them all, whatever servers and routes they crossed. Raises `ReceiverGone` when acks stop
        for `ack_timeout_s`."""
        await self._send.settled(subject)

    async def request(
        self, subject: str, message: msgspec.Struct, reply_type: type[T], timeout: float,
        headers: dict[str, str] | None = None,
    ) -> T:  # fmt: skip
        """Single-message request/reply. Raises `PayloadTooLarge` at once when the request does
        not fit `max_payload`, `nats.errors.NoRespondersError` at once when nobody listens,
        `nats.errors.TimeoutError` after `timeout`."""
        payload = self.encode(message)
        self._check_single(subject, payload, "request")
        reply = await self._nc.request(subject, payload, timeout=timeout, headers=headers)
        return msgspec.msgpack.decode(reply.data, type=reply_type)

    async def respond(self, request: Delivery, message: msgspec.Struct) -> None:
        """Answer a request that arrived through `subscribe`."""
        if not request.reply:
            raise TransportError(f"a message on {request.subject} has no reply subject to answer")
        payload = self.encode(message)
        self._check_single(request.reply, payload, "reply")
        await self._nc.publish(request.reply, payload)

    def _check_single(self, subject: str, payload: bytes | bytearray, kind: str) -> None:
        if len(payload) > self.max_payload:
            raise PayloadTooLarge(
                f"{kind} on {subject}: payload {len(payload)} bytes > server max_payload "
                f"{self.max_payload} bytes ({kind}s travel in one message, without chunking)"
            )

    async def subscribe(
        self, subject: str, message_type: type[T], handler: Handler[T], queue: str = "",
        on_gap: Callable[[str], None] | None = None,
    ) -> int:  # fmt: skip
        """Decode every message on `subject` as `message_type` and await `handler` on it, in order.
        Returns the subscription's id, for `unsubscribe`."""
        decoder = msgspec.msgpack.Decoder(message_type)
        receiver = SubscriptionReceiver(self, subject, decoder, handler, counts_gaps=not queue, on_gap=on_gap)
        # No pending limits on the receiving side: memory is bounded by the senders' flow-control
        # windows instead.
        sid = self._reader.subscribe(subject, receiver, queue)
        self._receivers.append(receiver)
        self._tasks += [asyncio.create_task(receiver.run()), asyncio.create_task(receiver.sweep())]
        return sid

    def on_receive_loss(self, listener: Callable[[], None]) -> None:
        """`listener()` runs each time the receiving connection came back after a disconnect:
        messages sent to this service meanwhile may be lost, with no later message to tell."""
        self.events.loss_listeners.append(listener)

    def _mark_sequences_soon(self) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(self._send.send_marks()))

    def _forget_sequences(self) -> None:
        """After a reconnect every sender is heard from anew: the loss listeners already failed
        what the lost messages belonged to, so the next number is not a gap."""
        for receiver in self._receivers:
            receiver.forget_senders()

    async def unsubscribe(self, sid: int) -> None:
        """No more messages for this subscription once this returns (a queue group's messages go
        to its other members); what already arrived is still handled."""
        self._reader.unsubscribe(sid)
        await self._reader.flush()

    async def _send_ack(self, delivery: Delivery) -> None:
        headers = delivery.headers or {}
        ack_subject = headers.get(ACK_HEADER)
        with contextlib.suppress(BadFraming):
            framing = parse_framing(headers)
            if ack_subject and framing is not None:
                with contextlib.suppress(Exception):  # a closing connection: the sender times out instead
                    await self._nc.publish(ack_subject, f"{framing[0]} {framing[1]}".encode())

    async def flush(self) -> None:
        """Round trips to the server: subscriptions made and messages published before this call
        are in effect after it."""
        await self._nc.flush()
        await self._reader.flush()

    async def close(self) -> None:
        """Stop receiving, flush publishes (acks included), close."""
        await self._reader.close()
        with contextlib.suppress(Exception):
            await self._nc.drain()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if not self._nc.is_closed:
            await self._nc.close()


def _callbacks(name: str, events: ConnectionEvents) -> dict[str, Callable[..., Awaitable[None]]]:
    async def error_cb(exc: Exception) -> None:
        events.errors.append(repr(exc))
        log.warning("nats.error", service=name, error=repr(exc))

    async def disconnected_cb() -> None:
        events.disconnects += 1
        log.warning("nats.disconnected", service=name)

    async def reconnected_cb() -> None:
        events.reconnects += 1
        for listener in events.send_loss_listeners:
            listener()
        log.info("nats.reconnected", service=name)

    return {"error_cb": error_cb, "disconnected_cb": disconnected_cb, "reconnected_cb": reconnected_cb}


async def _open_reader(connection: NatsConnection, name: str, events: ReaderEvents) -> NatsReader | NatsPyReader:
    """`NatsReader`, or a nats-py subscription connection where it cannot speak the connection."""
    reason = NatsReader.unsupported(connection)
    if reason is None:
        return await NatsReader.connect(connection, name, events)
    log.warning("transport.reader_fallback", service=name, reason=f"NatsReader does not speak {reason}",
                effect="subscriptions go through nats-py: slower for multi-MB messages")  # fmt: skip
    return await NatsPyReader.connect(connection, name, events)


def _reader_events(events: ConnectionEvents) -> ReaderEvents:
    """The reader's disconnects, reconnects and server errors count with nats-py's."""

    def disconnected() -> None:
        events.disconnects += 1

    def reconnected() -> None:
        events.reconnects += 1
        for listener in events.loss_listeners:
            listener()

    return ReaderEvents(on_disconnect=disconnected, on_reconnect=reconnected, on_error=events.errors.append)
