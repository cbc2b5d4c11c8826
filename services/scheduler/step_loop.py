"""The decode loop's thread: `core.step` back to back, one step ahead of what is published.

A step run through `asyncio.to_thread` comes back to the event loop before the next one can be
submitted, so the device idles for a loop round trip between steps (longer while the loop encodes
and publishes). `StepThread` steps in one thread of its own instead, as long as the core has
work, and hands each step's outputs to the event loop, which publishes them in step order. Its
lead is bounded: a step begins only once every step before the previous one is published (step
N + 1 runs while step N is published, never further ahead), so a slow network stops the device
instead of piling outputs up.

A step's outputs are handed over once the next step's device work is queued (`core.step`'s
on_queued), not as soon as the step returns. Handed over at once, the event loop's publication
(the wire's columns and their encoding in Python, more of it with top-20 rows; then NATS) took the
GIL at the step thread's next release of it and held it through the next launch, the step's
critical path. Handed over after the launch, it runs while the step thread waits for the device
with the GIL released, which serves top-20 streams faster on a slow host. A step that leaves
nothing in flight (`core.has_in_flight`) hands its outputs over at once: no launch of the next one
is coming.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from dataclasses import dataclass

from services.scheduler.core import SchedulerCore
from services.scheduler.request import RequestOutput
from services.scheduler.step_trace import StepTrace

STEPS_IN_FLIGHT = 2  # begun and not yet published: the one running, the one being published


@dataclass(frozen=True)
class StepResult:
    outputs: list[RequestOutput]
    step: int  # core.num_steps once the step was done
    queue_times: list[float]  # seconds from `add` to first scheduled, of the requests it scheduled first
    weight_version: str | None = None  # the weights the step's outputs come from (as at its start)


class StepThread:
    """Steps `core` in a thread of its own: `start`, then `next` / `published` per step from the
    event loop, `wake` when work arrives, `stop` to end it. `core.fail_all` is safe once `stop` has
    returned: no step runs then."""

    def __init__(self, core: SchedulerCore, trace: StepTrace | None = None) -> None:
        self._core = core
        self._trace = trace  # one line per step (`step_trace.py`); closed when the thread ends
        self._turn = threading.Condition()  # guards the two fields below; notified on every change
        self._num_unpublished = 0  # steps begun whose outputs the event loop has not published yet
        self._closing = False
        self._results: asyncio.Queue[StepResult | BaseException | None] = asyncio.Queue()
        self._exited: asyncio.Future[None] | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        context = contextvars.copy_context()  # the caller's log context, as asyncio.to_thread does
        threading.Thread(target=context.run, args=(self._run, loop), name="scheduler-step", daemon=True).start()

    def wake(self) -> None:
        """Work arrived (any thread): an idle thread checks `core.has_work` again."""
        with self._turn:
            self._turn.notify()

    async def next(self) -> StepResult | None:
        """The next step's outputs, in step order; None once the thread has stopped. Raises what a
        step raised (the thread has stopped then too)."""
        result = await self._results.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def published(self) -> None:
        """The outputs `next` returned last are published: one more step may begin."""
        with self._turn:
            self._num_unpublished -= 1
            self._turn.notify()

    async def stop(self) -> None:
        """Let the running step finish (its outputs and the ones before stay for `next`), then end
        the thread and wait for it."""
        with self._turn:
            self._closing = True
            self._turn.notify()
        if self._exited is not None:
            await asyncio.shield(self._exited)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        end: BaseException | None = None
        kept: list[StepResult] = []  # the last step's outputs, until the next step's device work is queued

        def hand_over() -> None:
            if kept:
                loop.call_soon_threadsafe(self._results.put_nowait, kept.pop())

        try:
            while (turn := self._wait_for_turn()) is not None:
                begin = time.monotonic()
                version = self._core.controls.weight_version
                outputs = self._core.step(hand_over)
                ended = time.monotonic()
                queue_times = list(self._core.take_queue_times().values())
                kept.append(StepResult(outputs, self._core.num_steps, queue_times, version))
                if not self._core.has_in_flight:
                    hand_over()
                if self._trace is not None:
                    self._write_trace(begin, ended, *turn, queue_times)
        except BaseException as exc:  # fatal for the scheduler: the event loop raises it from `next`
            end = exc
        finally:
            with contextlib.suppress(RuntimeError):  # (the loop is closed: nobody waits any more)
                hand_over()  # before the end: a failed step's error comes after the outputs before it
            if self._trace is not None:
                self._trace.close()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(self._exit, end)

    def _wait_for_turn(self) -> tuple[float, bool] | None:
        """Block until a step may begin (None: closing). No polling: arrivals, publications and
        `stop` notify. (seconds waited, whether an unpublished step held it)"""
        began = time.perf_counter()
        with self._turn:
            held = self._num_unpublished >= STEPS_IN_FLIGHT
            self._turn.wait_for(lambda: self._closing or (self._num_unpublished < STEPS_IN_FLIGHT and self._core.has_work()))
            if self._closing:
                return None
            self._num_unpublished += 1
        return time.perf_counter() - began, held

    def _write_trace(self, begin: float, ended: float, turn_s: float, held: bool, queue_times: list[float]) -> None:
        core = self._core
        self._trace.write(begin, ended, turn_s, held, core.last_step, core.policy.num_running, core.policy.num_waiting, queue_times)

    def _exit(self, end: BaseException | None) -> None:
        self._results.put_nowait(end)
        self._exited.set_result(None)
