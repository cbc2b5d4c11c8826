import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import pytest

from services.common.heartbeat import HeartbeatMonitor, HeartbeatPublisher
from services.common.lifecycle import wait_until
from services.common.transport import Transport


def beat_in_thread(url: str, stop: threading.Event, alive_for_s: float | None = None) -> threading.Thread:
    """A scheduler stand-in with its own event loop, so blocking the test's loop cannot stop it."""

    async def beat() -> None:
        transport = await Transport.connect(url, "beater")
        publisher = HeartbeatPublisher(transport, "scheduler", "s1", 0.1)
        publisher.start()
        started = time.monotonic()
        while not stop.is_set() and (alive_for_s is None or time.monotonic() - started < alive_for_s):
            await asyncio.sleep(0.05)
        await publisher.stop("done") if alive_for_s is None else publisher._task.cancel()
        await transport.close()

    thread = threading.Thread(target=lambda: asyncio.run(beat()), daemon=True)
    thread.start()
    return thread


@contextlib.asynccontextmanager
async def watching(url: str, timeout_s: float = 0.6) -> AsyncIterator[tuple[list[str], Transport, HeartbeatMonitor]]:
    """A started monitor of "scheduler" beats, the reasons it declared dead, and its transport."""
    dead: list[str] = []
    transport = await Transport.connect(url, "watcher")
    monitor = HeartbeatMonitor(transport, "scheduler", timeout_s, lambda instance, reason: dead.append(reason))
    await monitor.start()
    try:
        yield dead, transport, monitor
    finally:
        await monitor.stop()
        await transport.close()


@pytest.mark.timeout(30)
async def test_a_blocked_monitor_does_not_declare_a_live_instance_dead(nats_server):
    async with watching(nats_server.url) as (dead, transport, monitor):
        stop = threading.Event()
        thread = beat_in_thread(nats_server.url, stop)
        assert await wait_until(lambda: monitor.is_alive("s1"), 10.0)
        time.sleep(1.5)  # block this loop for longer than the timeout, as a heavy response build would
        await asyncio.sleep(0.5)
        assert dead == [] and monitor.is_alive("s1")
        stop.set()
        await asyncio.to_thread(thread.join, 10)
        assert await wait_until(lambda: dead, 10.0)
        assert "done" in dead[0]  # the dead sentinel is still heard, not silence declared later


@pytest.mark.timeout(30)
async def test_silence_is_declared_dead(nats_server):
    async with watching(nats_server.url) as (dead, transport, monitor):
        thread = beat_in_thread(nats_server.url, threading.Event(), alive_for_s=0.5)
        assert await wait_until(lambda: monitor.is_alive("s1"), 10.0)
        await asyncio.to_thread(thread.join, 10)  # it stops beating without a sentinel
        assert await wait_until(lambda: dead, 10.0)
        assert "silent" in dead[0]


async def publish_sentinel(url: str, drained: bool) -> None:
    transport = await Transport.connect(url, "leaver")
    await HeartbeatPublisher(transport, "scheduler", "s1", 0.1).stop("the scheduler is shutting down", drained=drained)
    await transport.close()


@pytest.mark.timeout(30)
async def test_a_drained_sentinel_takes_effect_one_timeout_later(nats_server):
    """Its last messages, already published, may be on a longer path than the sentinel's."""
    async with watching(nats_server.url, timeout_s=3.0) as (dead, transport, monitor):
        await publish_sentinel(nats_server.url, drained=True)
        while monitor.is_alive("s1") or not transport.events.traffic.messages_received:
            await asyncio.sleep(0.01)
        assert dead == [] and not monitor.is_gone("s1")  # heard, and within the grace
        while not dead:
            await asyncio.sleep(0.05)
        assert dead == ["the scheduler is shutting down"] and monitor.is_gone("s1")


@pytest.mark.timeout(30)
async def test_a_sentinel_that_is_not_drained_is_acted_on_at_once(nats_server):
    async with watching(nats_server.url) as (dead, transport, monitor):
        await publish_sentinel(nats_server.url, drained=False)
        while not transport.events.traffic.messages_received:
            await asyncio.sleep(0.01)
        assert dead == ["the scheduler is shutting down"] and monitor.is_gone("s1")
