"""The transport's receiving side: each subscription's `SubscriptionReceiver`, the reader's `PayloadSink`
that lands a framed message's chunks in one reassembly buffer, queues complete messages for
decode and handler and every chunk for its ack, and counts each sender's `Sw-Seq` numbers to
flag gaps; plus the helpers a service uses to tell who a gap is about (`remember_sender`,
`sender_of`). Apart from `transport.py`, which subscribes through it and sends the acks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import structlog

from services.common.framing import MARK_HEADER, MSG_HEADER, BadFraming, parse_framing, parse_seq
from services.common.nats_reader import Delivery

if TYPE_CHECKING:
    from services.common.transport import Handler, Transport

log = structlog.get_logger(__name__)

MAX_TRACKED_SENDERS = 4096  # per subscription; the least recently heard sender is forgotten first


def remember_sender(table: OrderedDict[str, str], delivery: Delivery, instance_id: str) -> None:
    """Map a message's Sw-Seq sender to the instance that sent it (what an `on_gap(sender)`
    handler needs), keeping the most recent `MAX_TRACKED_SENDERS`."""
    sender = sender_of(delivery)
    if sender is not None and table.get(sender) != instance_id:
        table[sender] = instance_id
        table.move_to_end(sender)
        if len(table) > MAX_TRACKED_SENDERS:
            table.popitem(last=False)


def sender_of(delivery: Delivery) -> str | None:
    """The Sw-Seq sender of a message: who an `on_gap(sender)` is about."""
    seq = parse_seq(delivery.headers)
    return seq[0] if seq is not None else None


@dataclass
class _Reassembly:
    """One framed message being received. Every chunk but the last has the first chunk's size,
    so the buffer is allocated at the first chunk and each chunk is read from the socket straight
    into its place (`NatsReader`): no copy, no join. `np.empty`, not `bytearray`: no zero fill."""

    expected: int
    chunk_size: int
    received: int = 0
    size: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    buffer: np.ndarray = field(init=False)  # uint8 [chunk_size * expected]

    def __post_init__(self) -> None:
        self.buffer = np.empty(self.chunk_size * self.expected, dtype=np.uint8)

    def fits(self, index: int, size: int) -> bool:
        """Chunk `index` is the next one and has a size the plan allows."""
        last = index == self.expected - 1
        return index == self.received and (0 < size <= self.chunk_size if last else size == self.chunk_size)

    def slot(self, index: int, size: int) -> memoryview:
        start = index * self.chunk_size
        return memoryview(self.buffer)[start : start + size]

    def landed(self, index: int, size: int) -> memoryview | None:
        """Chunk `index` is in place; the whole payload once it was the last one."""
        self.received += 1
        self.size = index * self.chunk_size + size
        self.last_seen = time.monotonic()
        return memoryview(self.buffer)[: self.size] if self.received == self.expected else None


class SubscriptionReceiver:
    """One subscription, as the reader's `PayloadSink`: picks where each payload lands (a chunk:
    its place in its message's buffer), then queues complete messages for decode and handler,
    and every chunk for its ack. It also counts each sender's `Sw-Seq` numbers (not for a queue
    group, whose members each see only a share of the messages)."""

    def __init__(
        self,
        transport: Transport,
        subject: str,
        decoder: msgspec.msgpack.Decoder,
        handler: Handler[Any],
        counts_gaps: bool = True,
        on_gap: Callable[[str], None] | None = None,
    ) -> None:
        self._transport = transport
        self._subject = subject
        self._decoder = decoder
        self._handler = handler
        self._counts_gaps = counts_gaps
        self._on_gap = on_gap  # (sender) for gaps a Sw-Mark reveals: no message to flag
        self._inbox: asyncio.Queue[tuple[memoryview | None, Delivery]] = asyncio.Queue()
        self._partial: dict[str, _Reassembly] = {}
        self._partial_bytes = 0  # reserved by the reassemblies in `_partial`
        # (sender, subject) -> last Sw-Seq number seen; the subject matters for wildcard subscriptions
        self._last_seq: OrderedDict[tuple[str, str], int] = OrderedDict()
        # What `target` decided for the payload being read: a chunk (message id, index, its
        # reassembly), or None with `_whole` telling a whole message from a dropped chunk.
        self._landing: tuple[str, int, _Reassembly] | None = None
        self._whole = False

    # PayloadSink (called by the reader, one message at a time)

    def target(self, delivery: Delivery, size: int) -> memoryview:
        self._landing = None
        try:
            framing = parse_framing(delivery.headers)
        except BadFraming as exc:
            return self._drop(delivery, size, "transport.bad_framing", error=str(exc))
        self._whole = framing is None or framing[2] == 1
        if self._whole:
            return memoryview(np.empty(size, dtype=np.uint8))  # not bytearray: no zero fill of what the socket overwrites
        msg_id, index, total = framing
        state = self._partial.get(msg_id)
        if state is None and index == 0:
            if (refusal := self._refusal(total, size)) is not None:
                return self._drop(delivery, size, "transport.reassembly_refused", msg_id=msg_id, error=refusal)
            state = self._partial[msg_id] = _Reassembly(expected=total, chunk_size=size)
            self._partial_bytes += state.buffer.nbytes
        if state is None or total != state.expected or not state.fits(index, size):
            # a lost chunk (core NATS is at-most-once) or a late joiner
            self._discard(msg_id)
            return self._drop(delivery, size, "transport.chunk_out_of_order", msg_id=msg_id, index=index,
                              have=state.received if state else None)  # fmt: skip
        self._landing = (msg_id, index, state)
        return state.slot(index, size)

    def landed(self, delivery: Delivery, payload: memoryview) -> None:
        landing, self._landing = self._landing, None
        traffic = self._transport.events.traffic
        traffic.chunks_received += 1
        traffic.bytes_received += len(payload)
        if landing is None:  # a whole message, or a dropped chunk (only acked)
            if self._whole and MARK_HEADER in (delivery.headers or {}):
                self._marked(delivery)
            else:
                self._inbox.put_nowait((payload, self._counted(delivery)) if self._whole else (None, delivery))
            return
        msg_id, index, state = landing
        complete = state.landed(index, len(payload))
        if complete is not None:
            self._discard(msg_id)  # the sweep may have dropped it meanwhile
            delivery = self._counted(delivery)
        self._inbox.put_nowait((complete, delivery))

    def forget_senders(self) -> None:
        self._last_seq.clear()

    def _refusal(self, total: int, chunk_size: int) -> str | None:
        """Why a message announced by its first chunk must not get a buffer; None when it may."""
        announced = total * chunk_size
        if announced > self._transport.max_message_bytes:
            return f"{total} chunks of {chunk_size} bytes exceed max_message_bytes {self._transport.max_message_bytes}"
        if self._partial_bytes + announced > self._transport.max_partial_bytes:
            return f"reassemblies in progress already hold {self._partial_bytes} bytes"
        return None

    def _drop(self, delivery: Delivery, size: int, event: str, **details: Any) -> memoryview:
        """Read the payload into scratch space and forget it (it is still acked)."""
        log.error(event, subject=self._subject, size=size, **details)
        self._whole = False
        return memoryview(bytearray(size))

    def _discard(self, msg_id: str) -> None:
        state = self._partial.pop(msg_id, None)
        if state is not None:
            self._partial_bytes -= state.buffer.nbytes

    def _counted(self, delivery: Delivery) -> Delivery:
        """The delivery of a complete message, with `missed` set when its sender skipped numbers."""
        missed = self._missed(delivery, after_last=True)
        return dataclasses.replace(delivery, missed=missed) if missed else delivery

    def _marked(self, delivery: Delivery) -> None:
        """A Sw-Mark: its number is the sender's last; anything after what we saw is lost."""
        missed = self._missed(delivery, after_last=False)
        seq = parse_seq(delivery.headers)
        if missed and seq is not None and self._on_gap is not None:
            self._on_gap(seq[0])

    def _missed(self, delivery: Delivery, after_last: bool) -> int:
        """Numbers skipped before this one (a message's own number comes after the last seen;
        a mark's is the last sent). 0 on first contact, in order, or for a duplicate."""
        seq = parse_seq(delivery.headers) if self._counts_gaps else None
        if seq is None:
            return 0
        sender, number = seq
        key = (sender, delivery.subject)
        last = self._last_seq.pop(key, None)
        self._last_seq[key] = number if last is None else max(number, last)
        if len(self._last_seq) > MAX_TRACKED_SENDERS:
            self._last_seq.popitem(last=False)
        missed = 0 if last is None else number - last - (1 if after_last else 0)
        if missed > 0:
            log.error("transport.messages_lost", subject=self._subject, sender=sender, missed=missed)
        return max(missed, 0)

    # the subscription's task

    async def run(self) -> None:
        while True:
            payload, delivery = await self._inbox.get()
            if payload is not None:
                self._transport.events.traffic.messages_received += 1
                await self._handle(payload, delivery)
            if delivery.headers and MSG_HEADER in delivery.headers:
                await self._transport._send_ack(delivery)  # after the handler for a message's last chunk

    async def sweep(self) -> None:
        """Drop reassemblies that got no chunk for the timeout (the sender died mid-message)."""
        timeout_s = self._transport._reassembly_timeout_s
        while True:
            await asyncio.sleep(timeout_s / 2)
            self._drop_stale(timeout_s)

    def _drop_stale(self, timeout_s: float) -> None:
        now = time.monotonic()
        for msg_id, state in list(self._partial.items()):
            if now - state.last_seen > timeout_s:
                log.warning("transport.reassembly_dropped", subject=self._subject, msg_id=msg_id,
                            have=state.received, expected=state.expected)  # fmt: skip
                self._discard(msg_id)

    async def _handle(self, payload: memoryview, delivery: Delivery) -> None:
        try:
            message = self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            log.error("transport.bad_message", subject=self._subject, error=str(exc))
            return
        try:
            await self._handler(message, delivery)
        except Exception:
            log.exception("transport.handler_failed", subject=self._subject)
