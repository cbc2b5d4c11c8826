"""The sender's side of the transport's flow control and gap marks: a window of unacked chunks
per destination subject (`Transport.publish` waits on it, `Transport.settled` for it to empty),
the ack inbox the chunks name, and the `Sw-Mark`s sent after the publishing connection came back.
Apart from `transport.py`: it is the publishing side's own state, which receiving never touches.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.common.framing import MARK_HEADER, SEQ_HEADER
from services.common.transport_errors import ReceiverGone

MARK_PAUSES_S = (0.0, 0.5, 1.0, 2.0, 4.0)  # Sw-Mark sends after a publishing reconnect
MARK_RECENT_S = 60.0  # subjects published to this recently get them


@dataclass
class SendWindow:
    """Flow-control state of one destination subject, on the sender side."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    outstanding: dict[str, tuple[int, float]] = field(default_factory=dict)  # ack key -> (bytes, sent_at); oldest first
    num_bytes: int = 0
    seq: itertools.count[int] = field(default_factory=itertools.count)  # next Sw-Seq number to this subject
    last_number: int | None = None  # the last Sw-Seq number sent to this subject
    last_sent: float = 0.0

    def add(self, key: str, size: int) -> None:
        self.outstanding[key] = (size, time.monotonic())
        self.num_bytes += size

    def release(self, key: str) -> None:
        size, _ = self.outstanding.pop(key)
        self.num_bytes -= size
        self.changed.set()

    def oldest_sent_at(self) -> float:
        return next(iter(self.outstanding.values()))[1]

    def forget(self) -> None:
        self.outstanding.clear()
        self.num_bytes = 0


class SendWindows:
    """The sender's side of flow control and gap marks: a window per destination subject, the ack
    inbox every framed chunk names, and the marks sent after the publishing connection returns."""

    def __init__(self, nc: Client, sender_id: str, window_bytes: int, ack_timeout_s: float) -> None:
        self._nc = nc
        self._sender_id = sender_id
        self.window_bytes = window_bytes  # 0 disables flow control
        self._ack_timeout_s = ack_timeout_s
        self.windows: dict[str, SendWindow] = {}
        self.ack_keys: dict[str, str] = {}  # ack key -> destination subject
        self._ack_subject: str | None = None

    def of(self, subject: str) -> SendWindow:
        return self.windows.get(subject) or self.windows.setdefault(subject, SendWindow())

    async def acquire(self, subject: str, window: SendWindow, key: str, size: int) -> None:
        """Wait until `size` more bytes fit in `subject`'s window (one chunk always fits an empty
        one), then count the chunk `key` in it."""
        await self._wait(subject, window, lambda: window.num_bytes + size > self.window_bytes)
        self.ack_keys[key] = subject
        window.add(key, size)

    async def settled(self, subject: str) -> None:
        """Wait until every chunk sent to `subject` is acked."""
        if subject in self.windows and self.window_bytes > 0:
            await self._wait(subject, self.windows[subject], lambda: True)

    async def _wait(self, subject: str, window: SendWindow, too_full: Callable[[], bool]) -> None:
        """While `window` holds chunks and `too_full()`; `ReceiverGone` once its oldest chunk went
        unacked for the ack timeout."""
        while window.num_bytes and too_full():
            remaining = window.oldest_sent_at() + self._ack_timeout_s - time.monotonic()
            if remaining <= 0:
                self._forget(window)
                raise ReceiverGone(
                    f"{subject}: no flow-control ack for {self._ack_timeout_s:.1f}s with "
                    f"{window.num_bytes} bytes unacked; the receiver is gone or stuck"
                )
            window.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(window.changed.wait(), remaining)

    def _forget(self, window: SendWindow) -> None:
        for key in window.outstanding:
            self.ack_keys.pop(key, None)
        window.forget()

    async def ack_inbox(self) -> str:
        if self._ack_subject is None:
            subject = self._nc.new_inbox()
            await self._nc.subscribe(subject, cb=self._on_ack, pending_msgs_limit=-1, pending_bytes_limit=-1)
            self._ack_subject = subject
        return self._ack_subject

    async def _on_ack(self, msg: Msg) -> None:
        key = msg.data.decode(errors="replace")
        subject = self.ack_keys.pop(key, None)
        if subject is not None:  # unknown keys: duplicates, or acks for a forgotten window
            self.windows[subject].release(key)

    async def send_marks(self) -> None:
        """Our publishing connection dropped and came back. What it sent just before may be lost,
        and when that was a subject's last message no later one shows the gap: tell each recent
        destination the last number sent (`Sw-Mark`), a few times, since its own connection may
        come back later than ours."""
        for pause in MARK_PAUSES_S:
            await asyncio.sleep(pause)
            now = time.monotonic()
            for subject, window in list(self.windows.items()):
                if window.last_number is not None and now - window.last_sent < MARK_RECENT_S:
                    async with window.lock:  # after any message already numbered
                        mark = {SEQ_HEADER: f"{self._sender_id} {window.last_number}", MARK_HEADER: "1"}
                        with contextlib.suppress(Exception):
                            await self._nc.publish(subject, b"", headers=mark)
