"""`StepThread` alone, over a stand-in core whose steps the test paces (no model, no NATS)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.scheduler.between_steps import BetweenSteps
from services.scheduler.step_loop import StepThread

RUN_AHEAD_CHANCE_S = 0.1  # time a loop that ignored the bound would have to begin one more step


class PacedCore:
    """Has `steps_left` steps of work; step k returns [k]. Each step queues its device work (calls
    `on_queued`; `queued` counts them), then waits for a permit from `allow`; `began` counts the
    steps begun, `began_event` is a loop-side Event set on every step begun. follows: each step
    leaves the next one in flight while work is left (`has_in_flight`), as overlapped decoding does."""

    def __init__(self, loop: asyncio.AbstractEventLoop, steps_left: int, *, fail_at: int | None = None, follows: bool = False,
                 gate_queue_at: int | None = None) -> None:  # fmt: skip
        self.loop, self.steps_left, self.fail_at, self.follows = loop, steps_left, fail_at, follows
        self.gate_queue_at, self.queue_gate = gate_queue_at, threading.Event()  # that step queues once the gate is set
        self.permits = threading.Semaphore(0)
        self.controls = BetweenSteps()  # the weight_version each step's outputs are tagged with
        self.began = 0
        self.queued = 0
        self.num_steps = 0
        self.stepping = False
        self.began_event = asyncio.Event()
        self._lock = threading.Lock()

    def allow(self, num_steps: int = 1) -> None:
        self.permits.release(num_steps)

    def add_work(self, num_steps: int) -> None:
        with self._lock:
            self.steps_left += num_steps

    def has_work(self) -> bool:
        with self._lock:
            return self.steps_left > 0

    @property
    def has_in_flight(self) -> bool:
        return self.follows and self.has_work()

    def step(self, on_queued=None) -> list[int]:
        self.stepping = True
        self.began += 1
        self.loop.call_soon_threadsafe(self.began_event.set)
        if self.began == self.fail_at:  # before it queues anything
            self.stepping = False
            raise RuntimeError("device lost")
        if self.began == self.gate_queue_at:
            self.queue_gate.wait()
        self.queued += 1
        on_queued()
        self.permits.acquire()
        with self._lock:
            self.steps_left -= 1
        self.num_steps += 1
        self.stepping = False
        return [self.num_steps]

    def take_queue_times(self) -> dict[str, float]:
        return {f"r{self.num_steps}": 0.5}


async def _until_began(core: PacedCore, num_steps: int) -> None:
    while core.began < num_steps:
        core.began_event.clear()
        if core.began < num_steps:
            await core.began_event.wait()


@pytest.mark.timeout(30)
async def test_outputs_come_in_step_order_with_their_step_number_and_queue_times():
    core = PacedCore(asyncio.get_running_loop(), steps_left=8)
    core.allow(8)
    steps = StepThread(core)
    steps.start()
    seen = []
    for _ in range(8):
        result = await asyncio.wait_for(steps.next(), 10)
        seen.append((result.outputs, result.step, result.queue_times))
        await asyncio.sleep(0.001 * (len(seen) % 3))  # publications of uneven length
        steps.published()
    await steps.stop()
    assert seen == [([k], k, [0.5]) for k in range(1, 9)]
    assert await asyncio.wait_for(steps.next(), 10) is None  # stopped: nothing after the last step


@pytest.mark.timeout(30)
async def test_a_blocked_publish_lets_exactly_one_more_step_run():
    """While step 1's outputs are being published (and that blocks), step 2 runs, and step 3 does
    not begin until step 1 is published."""
    core = PacedCore(asyncio.get_running_loop(), steps_left=10)
    core.allow(10)
    steps = StepThread(core)
    steps.start()
    first = await asyncio.wait_for(steps.next(), 10)  # its publication blocks from here on
    second = await asyncio.wait_for(steps.next(), 10)  # the one step allowed ahead
    await asyncio.sleep(RUN_AHEAD_CHANCE_S)
    assert (first.step, second.step, core.began) == (1, 2, 2)
    steps.published()  # step 1 is out: step 3 may begin, not step 4
    await asyncio.wait_for(_until_began(core, 3), 10)
    third = await asyncio.wait_for(steps.next(), 10)
    await asyncio.sleep(RUN_AHEAD_CHANCE_S)
    assert (third.step, core.began) == (3, 3)
    await steps.stop()


@pytest.mark.timeout(30)
async def test_an_idle_thread_wakes_when_work_arrives():
    core = PacedCore(asyncio.get_running_loop(), steps_left=1)
    core.allow(3)
    steps = StepThread(core)
    steps.start()
    assert (await asyncio.wait_for(steps.next(), 10)).step == 1
    steps.published()
    await asyncio.sleep(RUN_AHEAD_CHANCE_S)  # no work: the thread goes idle
    assert core.began == 1
    core.add_work(2)
    steps.wake()
    assert [(await asyncio.wait_for(steps.next(), 10)).step for _ in range(2)] == [2, 3]
    await steps.stop()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("follows", [False, True])  # followed: step 2's outputs are kept until step 3 queues, which it never does
async def test_a_failed_step_comes_after_the_outputs_before_it_and_ends_the_thread(follows):
    core = PacedCore(asyncio.get_running_loop(), steps_left=10, fail_at=3, follows=follows)
    core.allow(10)
    steps = StepThread(core)
    steps.start()
    for expected in (1, 2):
        assert (await asyncio.wait_for(steps.next(), 10)).step == expected
        steps.published()
    with pytest.raises(RuntimeError, match="device lost"):
        await asyncio.wait_for(steps.next(), 10)
    await asyncio.wait_for(steps.stop(), 10)  # already ended: returns at once
    assert core.began == 3 and core.queued == 2 and not core.stepping


@pytest.mark.timeout(30)
async def test_stop_waits_for_the_running_step_and_keeps_its_outputs():
    """`stop` during a step returns only once that step is done (no step runs afterwards, so the
    service may call fail_all), and the step's outputs are still handed over, then the end."""
    core = PacedCore(asyncio.get_running_loop(), steps_left=10)
    steps = StepThread(core)
    steps.start()
    await asyncio.wait_for(_until_began(core, 1), 10)
    stopping = asyncio.create_task(steps.stop())
    await asyncio.sleep(RUN_AHEAD_CHANCE_S)
    assert not stopping.done()  # the step still runs
    core.allow(10)
    await asyncio.wait_for(stopping, 10)
    assert not core.stepping and core.began == 1
    assert (await asyncio.wait_for(steps.next(), 10)).step == 1
    assert await asyncio.wait_for(steps.next(), 10) is None


@pytest.mark.timeout(30)
async def test_stop_ends_a_thread_waiting_on_an_unpublished_step():
    """A decode loop that stops publishing (it failed) can still stop the thread, even while the
    thread waits for a publication that never comes."""
    core = PacedCore(asyncio.get_running_loop(), steps_left=10)
    core.allow(10)
    steps = StepThread(core)
    steps.start()
    await asyncio.wait_for(_until_began(core, 2), 10)
    await asyncio.wait_for(steps.stop(), 10)
    assert core.began == 2


@pytest.mark.timeout(30)
async def test_a_followed_steps_outputs_come_once_the_next_step_is_queued_and_the_last_at_once():
    """With the next step in flight behind each, step k's outputs are handed over once step k + 1 has
    queued its device work, while it still runs (its publication overlaps the wait for the device,
    not the launch); the last step, nothing in flight behind it, hands its own over as it ends."""
    core = PacedCore(asyncio.get_running_loop(), steps_left=3, follows=True, gate_queue_at=2)
    core.allow(1)
    steps = StepThread(core)
    steps.start()
    await asyncio.wait_for(_until_began(core, 2), 10)
    with pytest.raises(TimeoutError):  # step 1 is done, step 2 has not queued yet: nothing handed over
        await asyncio.wait_for(steps.next(), RUN_AHEAD_CHANCE_S)
    core.queue_gate.set()
    first = await asyncio.wait_for(steps.next(), 10)
    assert (first.outputs, first.step) == ([1], 1)
    assert (core.began, core.queued, core.stepping) == (2, 2, True)  # step 2 queued, still running
    steps.published()
    core.allow(2)
    rest = [await asyncio.wait_for(steps.next(), 10) for _ in range(2)]
    assert [(r.outputs, r.step) for r in rest] == [([2], 2), ([3], 3)] and core.began == 3
    steps.published()
    steps.published()
    await steps.stop()
    assert await asyncio.wait_for(steps.next(), 10) is None


@pytest.mark.timeout(30)
async def test_stop_during_a_followed_step_keeps_the_outputs_of_both_steps():
    core = PacedCore(asyncio.get_running_loop(), steps_left=10, follows=True)
    core.allow(1)
    steps = StepThread(core)
    steps.start()
    assert (await asyncio.wait_for(steps.next(), 10)).step == 1  # step 2 queued, waiting for its permit
    steps.published()
    stopping = asyncio.create_task(steps.stop())
    await asyncio.sleep(RUN_AHEAD_CHANCE_S)
    assert not stopping.done()
    core.allow(10)
    await asyncio.wait_for(stopping, 10)
    assert (await asyncio.wait_for(steps.next(), 10)).step == 2  # held for step 3, which never began
    assert await asyncio.wait_for(steps.next(), 10) is None and core.began == 2
