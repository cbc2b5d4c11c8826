"""`lifecycle`: running a service's loop, start-up work a stop abandons, and waiting for a drain."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from services.common.lifecycle import ABANDONABLE, in_daemon_thread, run_event_loop, unless_stopped, wait_until
from services.common.memory import YOUNG_COLLECTION_THRESHOLD


async def test_wait_until_returns_once_done_and_gives_up_after_the_timeout():
    ticks = iter(range(100))
    assert await wait_until(lambda: next(ticks) >= 3, 5.0, poll_s=0.001)
    assert not await wait_until(lambda: False, 0.05, poll_s=0.01)


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_run_event_loop_runs_on_the_chosen_loop(event_loop):
    async def loop_name() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_event_loop(loop_name(), event_loop).startswith(event_loop)


@pytest.mark.parametrize(
    "settings, refused",
    [(("trio", "tuned"), "event loop"), (("uvloop", "jemalloc"), "allocator"), (("uvloop", "tuned", "off"), "collector")],
)
def test_unknown_settings_are_refused(settings, refused):
    never_run = asyncio.sleep(0)
    with pytest.raises(ValueError, match=refused):
        run_event_loop(never_run, *settings)
    never_run.close()


@pytest.mark.parametrize("collector", ["tuned", "default"])
def test_run_event_loop_runs_the_service_under_the_chosen_collector_and_restores_it(collector):
    async def young_threshold() -> int:
        return gc.get_threshold()[0]

    saved = gc.get_threshold()
    expected = YOUNG_COLLECTION_THRESHOLD if collector == "tuned" else saved[0]
    assert run_event_loop(young_threshold(), "uvloop", "tuned", collector) == expected
    assert gc.get_threshold() == saved


async def test_unless_stopped_gives_the_result_or_none_once_stopped():
    stop = asyncio.Event()
    assert await unless_stopped(asyncio.sleep(0, result=7), stop) == 7
    never = asyncio.ensure_future(asyncio.Event().wait())
    asyncio.get_running_loop().call_later(0.05, stop.set)
    assert await unless_stopped(never, stop) is None
    assert never.cancelled()


async def test_unless_stopped_raises_what_the_work_raises():
    async def fails() -> None:
        raise OSError("no such model")

    with pytest.raises(OSError, match="no such model"):
        await unless_stopped(fails(), asyncio.Event())


async def test_in_daemon_thread_returns_raises_and_can_be_abandoned():
    assert await in_daemon_thread(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(KeyError):
        await in_daemon_thread({}.__getitem__, "missing")
    release = threading.Event()
    held = in_daemon_thread(release.wait)
    thread = next(t for t in threading.enumerate() if t.name.startswith(ABANDONABLE) and t.is_alive())
    assert thread.daemon  # the exit does not join it (lifecycle.leave ends the process past it)
    held.cancel()
    release.set()  # the thread's late result lands on a cancelled future: dropped
    thread.join(5)
    await asyncio.sleep(0.01)
    assert held.cancelled() and not thread.is_alive()
