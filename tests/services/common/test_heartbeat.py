import asyncio
import threading
import time

import pytest

from services.common.heartbeat import HeartbeatMonitor, HeartbeatPublisher
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


async def start_monitor(url: str, dead: list[str]) -> tuple[Transport, HeartbeatMonitor]:
    transport = await Transport.connect(url, "watcher")
    monitor = HeartbeatMonitor(transport, "scheduler", 0.6, lambda instance, reason: dead.append(reason))
    await monitor.start()
    return transport, monitor


@pytest.mark.timeout(30)
async def test_a_blocked_monitor_does_not_declare_a_live_instance_dead(nats_server):
    dead: list[str] = []
    transport, monitor = await start_monitor(nats_server.url, dead)
    stop = threading.Event()
    thread = beat_in_thread(nats_server.url, stop)
    await asyncio.sleep(0.5)
    assert monitor.is_alive("s1")
    time.sleep(1.5)  # block this loop for longer than the timeout, as a heavy response build would
    await asyncio.sleep(0.5)
    assert dead == [] and monitor.is_alive("s1")
    stop.set()
    await asyncio.to_thread(thread.join, 10)
    await asyncio.sleep(0.3)
    assert dead and "done" in dead[0]  # the dead sentinel is still heard at once
    await monitor.stop()
    await transport.close()


@pytest.mark.timeout(30)
async def test_silence_is_declared_dead(nats_server):
    dead: list[str] = []
    transport, monitor = await start_monitor(nats_server.url, dead)
    thread = beat_in_thread(nats_server.url, threading.Event(), alive_for_s=0.5)
    await asyncio.sleep(0.4)
    assert monitor.is_alive("s1")
    await asyncio.to_thread(thread.join, 10)
    await asyncio.sleep(1.2)
    assert dead and "silent" in dead[0]
    await monitor.stop()
    await transport.close()
