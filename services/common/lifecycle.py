"""Process lifecycle shared by the services: a stop event set by SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

from services.common.memory import keep_large_buffers_mapped

T = TypeVar("T")
EVENT_LOOPS = ("uvloop", "asyncio")


def new_instance_id() -> str:
    return uuid.uuid4().hex


def stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


def run_event_loop(main: Coroutine[Any, Any, T], event_loop: str = "uvloop") -> T:
    """Run a service's main coroutine to the end. uvloop (libuv's loop) is the default: it moves
    large NATS messages with less CPU than asyncio's selector loop, which matters on a 2-core box
    (`sparkwire bench logprob-transport` measures both in one run)."""
    if event_loop not in EVENT_LOOPS:
        raise ValueError(f"event loop {event_loop!r}: expected one of {', '.join(EVENT_LOOPS)}")
    keep_large_buffers_mapped()
    return uvloop.run(main) if event_loop == "uvloop" else asyncio.run(main)
