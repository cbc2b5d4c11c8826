"""The fallback receiver: the same interface as `NatsReader`, over a nats-py connection.

Used only for connections `NatsReader` cannot speak (`NatsReader.unsupported`: websocket
servers). It costs what `NatsReader` saves (nats-py copies each payload several times), so the
service says so once, when it connects.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.common.connection import NatsConnection
from services.common.nats_reader import Delivery, PayloadSink, ReaderEvents
from services.common.nats_start import connect_nats_py


@dataclass
class NatsPyReader:
    nc: Client
    _sids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _subscriptions: dict[int, asyncio.Task[Subscription]] = field(default_factory=dict)
    _pending: list[asyncio.Task[object]] = field(default_factory=list)  # SUB/UNSUB not yet sent

    @classmethod
    async def connect(cls, connection: NatsConnection, name: str, events: ReaderEvents) -> NatsPyReader:
        async def disconnected() -> None:
            events.on_disconnect()

        async def reconnected() -> None:
            events.on_reconnect()

        async def error(exc: Exception) -> None:
            events.on_error(repr(exc))

        nc = await connect_nats_py(
            connection, f"{name}-reader", error, disconnected_cb=disconnected, reconnected_cb=reconnected
        )
        return cls(nc)

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected

    def subscribe(self, subject: str, sink: PayloadSink, queue: str = "") -> int:
        """Synchronous like `NatsReader.subscribe`: the SUB goes out from a task; `flush` waits for it."""

        async def deliver(msg: Msg) -> None:
            delivery = Delivery(msg.subject, msg.reply or None, msg.headers)
            target = sink.target(delivery, len(msg.data))
            target[:] = msg.data
            sink.landed(delivery, target)

        sid = next(self._sids)
        self._subscriptions[sid] = self._later(
            self.nc.subscribe(subject, queue=queue, cb=deliver, pending_msgs_limit=-1, pending_bytes_limit=-1)
        )
        return sid

    def unsubscribe(self, sid: int) -> None:
        subscribing = self._subscriptions.pop(sid, None)
        if subscribing is not None:
            self._later(_unsubscribe(subscribing))

    def _later(self, coroutine):  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coroutine)
        self._pending.append(task)
        return task

    async def flush(self, timeout: float = 5.0) -> None:
        pending, self._pending = self._pending, []
        await asyncio.gather(*pending)
        await self.nc.flush(timeout)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.drain()
        if not self.nc.is_closed:
            await self.nc.close()


async def _unsubscribe(subscribing: asyncio.Task[Subscription]) -> None:
    await (await subscribing).unsubscribe()
