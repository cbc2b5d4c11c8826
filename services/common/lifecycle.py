"""Process lifecycle shared by the services: a stop event set by SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import uuid
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import uvloop

from services.common.memory import keep_large_buffers_mapped
from services.common.nats_start import NatsStartError
from services.common.settings import EnvSettings

T = TypeVar("T")
EVENT_LOOPS = ("uvloop", "asyncio")
ALLOCATOR_MODES = ("tuned", "default")


def new_instance_id() -> str:
    return uuid.uuid4().hex


def stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def wait_until(done: Callable[[], bool], timeout_s: float, poll_s: float = 0.02) -> bool:
    """Poll `done` until it is true (True) or `timeout_s` has passed (False): how a draining
    service waits for the work it holds to finish."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


def run_event_loop(main: Coroutine[Any, Any, T], event_loop: str = "uvloop", allocator: str = "tuned") -> T:
    """Run a service's main coroutine to the end. uvloop (libuv's loop) is the default: it moves
    large NATS messages with less CPU than asyncio's selector loop, which matters on a 2-core box.
    `allocator="tuned"` applies `memory.keep_large_buffers_mapped` first. (`sparkwire bench
    logprob-transport` measures the defaults against each alternative in one run.)"""
    if event_loop not in EVENT_LOOPS:
        raise ValueError(f"event loop {event_loop!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if allocator not in ALLOCATOR_MODES:
        raise ValueError(f"allocator {allocator!r}: expected one of {', '.join(ALLOCATOR_MODES)}")
    if allocator == "tuned":
        keep_large_buffers_mapped()
    return uvloop.run(main) if event_loop == "uvloop" else asyncio.run(main)


def run_service(main: Coroutine[Any, Any, T]) -> T:
    """`run_event_loop` with the event loop and allocator mode of the environment (`SPARKWIRE_*`).
    A service that cannot make its first NATS connection exits with one line and status 1."""
    env = EnvSettings.from_environ()
    try:
        return run_event_loop(main, env.event_loop, env.allocator)
    except NatsStartError as exc:
        raise SystemExit(f"sparkwire: {exc}") from None
