"""`lifecycle`: running a service's loop, and waiting for a drain."""

from __future__ import annotations

import asyncio

import pytest

from services.common.lifecycle import run_event_loop, wait_until


async def test_wait_until_returns_once_done_and_gives_up_after_the_timeout():
    ticks = iter(range(100))
    assert await wait_until(lambda: next(ticks) >= 3, 5.0, poll_s=0.001)
    assert not await wait_until(lambda: False, 0.05, poll_s=0.01)


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_run_event_loop_runs_on_the_chosen_loop(event_loop):
    async def loop_name() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_event_loop(loop_name(), event_loop).startswith(event_loop)


@pytest.mark.parametrize("settings, refused", [(("trio", "tuned"), "event loop"), (("uvloop", "jemalloc"), "allocator")])
def test_unknown_settings_are_refused(settings, refused):
    never_run = asyncio.sleep(0)
    with pytest.raises(ValueError, match=refused):
        run_event_loop(never_run, *settings)
    never_run.close()
