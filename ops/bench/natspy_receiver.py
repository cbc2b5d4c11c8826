"""The baseline for `NatsReader` in `sparkwire bench logprob-transport`: framed messages received
through a plain nats-py subscription, as `services.common.transport` did before the reader.

nats-py hands each chunk over as `bytes` (after its own buffering and slicing); the chunk is then
copied to its place in a reassembly buffer, acked, and the whole message decoded once complete.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.common.framing import ACK_HEADER, CHUNK_HEADER, MSG_HEADER


class NatsPyReceiver:
    def __init__(self, nc: Client, message_type: type, on_message: Callable[[Any], None]) -> None:
        self._nc = nc
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._on_message = on_message
        self._buffers: dict[str, tuple[bytearray, int]] = {}  # message id -> (buffer, chunk size)

    async def subscribe(self, subject: str) -> None:
        await self._nc.subscribe(subject, cb=self._on_chunk, pending_msgs_limit=-1, pending_bytes_limit=-1)
        await self._nc.flush()

    async def _on_chunk(self, msg: Msg) -> None:
        headers = msg.headers or {}
        if MSG_HEADER not in headers:  # small enough to travel whole
            self._on_message(self._decoder.decode(msg.data))
            return
        msg_id = headers[MSG_HEADER]
        index, total = (int(part) for part in headers[CHUNK_HEADER].split("/"))
        if index == 0:
            self._buffers[msg_id] = (bytearray(len(msg.data) * total), len(msg.data))
        buffer, chunk_size = self._buffers[msg_id]
        start = index * chunk_size
        buffer[start : start + len(msg.data)] = msg.data
        if index == total - 1:
            del self._buffers[msg_id]
            self._on_message(self._decoder.decode(memoryview(buffer)[: start + len(msg.data)]))
        await self._nc.publish(headers[ACK_HEADER], f"{msg_id} {index}".encode())
