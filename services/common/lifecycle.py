"""Process lifecycle shared by the services: a stop event set by SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import signal
import sys
import threading
import uuid
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import uvloop

from services.common.memory import COLLECTOR_MODES, collector_tuned, keep_large_buffers_mapped
from services.common.nats_start import NatsStartError
from services.common.settings import EnvSettings

T = TypeVar("T")
EVENT_LOOPS = ("uvloop", "asyncio")
ALLOCATOR_MODES = ("tuned", "default")
ABANDONABLE = "sparkwire-abandonable"  # the name of every `in_daemon_thread` thread


def new_instance_id() -> str:
    return uuid.uuid4().hex


def stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """`work`'s result, or None once `stop` is set first (`work` is then cancelled): a start-up
    step (the first NATS connection, a model load) that a SIGTERM must not have to wait out."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


def in_daemon_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """`fn(*args)` in a daemon thread of its own. For start-up work of minutes (a model load)
    that a stop may abandon: `asyncio.to_thread`'s threads are joined at exit, so a SIGTERM would
    wait out the whole load. Cancelling the future abandons the work; see `leave`."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()  # the caller's log context, as asyncio.to_thread does

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # cancelled: the work was abandoned
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            outcome = (context.run(fn, *args), None)
        except BaseException as exc:  # handed to the awaiting coroutine, like to_thread does
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: nobody waits for this result any more
            pass

    threading.Thread(target=target, name=f"{ABANDONABLE}-{getattr(fn, '__name__', 'work')}", daemon=True).start()
    return future


def leave(code: int) -> int:
    """`code`, for the caller to exit with; but while an abandoned `in_daemon_thread` thread still
    runs, the process ends here at once (stdout and stderr flushed): interpreter finalization
    would stop that thread inside native code, and pthread_exit unwinding through torch's C++
    frames aborts the process ("terminate called without an active exception", SIGABRT)."""
    if any(thread.name.startswith(ABANDONABLE) and thread.is_alive() for thread in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


async def wait_until(done: Callable[[], bool], timeout_s: float, poll_s: float = 0.02) -> bool:
    """Poll `done` until it is true (True) or `timeout_s` has passed (False): how a draining
    service waits for the work it holds to finish."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


def run_event_loop(
    main: Coroutine[Any, Any, T], event_loop: str = "uvloop", allocator: str = "tuned", collector: str = "tuned"
) -> T:
    """Run a service's main coroutine to the end. uvloop (libuv's loop) is the default: it moves
    large NATS messages with less CPU than asyncio's selector loop, which matters on a 2-core box.
    `allocator="tuned"` applies `memory.keep_large_buffers_mapped` first. (`sparkwire bench
    logprob-transport` measures the defaults against each alternative in one run.)
    `collector="tuned"` runs it inside `memory.collector_tuned` (the service calls
    `memory.settle_startup_heap` once ready); "default" leaves CPython's collector as it is."""
    if event_loop not in EVENT_LOOPS:
        raise ValueError(f"event loop {event_loop!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if allocator not in ALLOCATOR_MODES:
        raise ValueError(f"allocator {allocator!r}: expected one of {', '.join(ALLOCATOR_MODES)}")
    if collector not in COLLECTOR_MODES:
        raise ValueError(f"collector {collector!r}: expected one of {', '.join(COLLECTOR_MODES)}")
    if allocator == "tuned":
        keep_large_buffers_mapped()
    with collector_tuned() if collector == "tuned" else contextlib.nullcontext():
        return uvloop.run(main) if event_loop == "uvloop" else asyncio.run(main)


def run_service(main: Coroutine[Any, Any, T]) -> T:
    """`run_event_loop` with the event loop, allocator and collector modes of the environment (`SPARKWIRE_*`).
    A service that cannot make its first NATS connection exits with one line and status 1."""
    env = EnvSettings.from_environ()
    try:
        return run_event_loop(main, env.event_loop, env.allocator, env.collector)
    except NatsStartError as exc:
        raise SystemExit(f"sparkwire: {exc}") from None
