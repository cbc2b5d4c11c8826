"""A client subscription whose decoded messages land in an `asyncio.Queue`, for tests that wait on them."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from services.common.transport import Transport

T = TypeVar("T")


async def queued(client: Transport, subject: str, message_type: type[T]) -> asyncio.Queue[T]:
    """Subscribe `client` to `subject`; flush before relying on the subscription being live."""
    messages: asyncio.Queue[T] = asyncio.Queue()

    async def put(message: T, _msg) -> None:
        messages.put_nowait(message)

    await client.subscribe(subject, message_type, put)
    return messages
