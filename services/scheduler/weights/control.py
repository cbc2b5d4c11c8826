"""The scheduler's RL controls over NATS: each becomes a `Control` the core runs between steps.

In: `Control` requests on `scheduler_control(id)` (update from disk, pause, continue, release,
resume), a push's `WeightManifest`, `WeightPiece`s and `WeightCommit` on `scheduler_weights(id)`. Each request is
answered with a `ControlReply` once the core ran it (or refused it: the old state keeps serving).
Reading new weights (disk, or the pieces' buffers) happens off the step thread; the step thread
only copies them into the served tensors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog
import torch

from contracts import subjects
from contracts.weights import (
    Control,
    ContinueGeneration,
    ControlReply,
    PauseGeneration,
    ReleaseMemory,
    UpdateFromDisk,
    WeightCommit,
    WeightManifest,
    WeightMessage,
    WeightPiece,
    WeightTarget,
)
from services.common.nats_reader import Delivery
from services.common.transport import Transport
from services.scheduler import between_steps
from services.scheduler.between_steps import Control as CoreControl
from services.scheduler.core import SchedulerCore
from services.scheduler.request import RequestOutput
from services.scheduler.weights import memory
from services.scheduler.weights.pieces import IncompleteVersion, PushedVersions
from services.scheduler.weights.tensors import WeightMismatch, check_shapes, copy_weights, read_safetensors, served_tensors

log = structlog.get_logger(__name__)

UPDATE_ABORT = "aborted: the weights are being updated (abort_all_requests)"
PAUSE_ABORT = "aborted: generation paused"
REFUSALS = (WeightMismatch, IncompleteVersion, OSError, RuntimeError)


class SchedulerControls:
    def __init__(self, core: SchedulerCore, scheduler_id: str, wake: Callable[[], None]) -> None:
        self._core = core
        self._id = scheduler_id
        self._wake = wake  # the step thread: a control is work
        self._pushed = PushedVersions()
        self._released: memory.Released | None = None
        self._num_updates = 0  # the default weight_version: "0" at start-up, then a count of the swaps
        self._transport: Transport | None = None

    async def subscribe(self, transport: Transport) -> None:
        self._transport = transport
        await transport.subscribe(subjects.scheduler_control(self._id), Control, self._on_control)
        await transport.subscribe(subjects.scheduler_weights(self._id), WeightMessage, self._on_weights)

    async def _on_control(self, message: Control, msg: Delivery) -> None:
        await self._transport.respond(msg, await self._answer(self._control(message)))

    async def _on_weights(self, message: WeightMessage, msg: Delivery) -> None:
        if isinstance(message, WeightManifest):  # its buffers are allocated while the pieces travel
            self._pushed.plan(message)
            return
        if isinstance(message, WeightPiece):  # checked and copied off the loop: it reads the next piece meanwhile
            await asyncio.to_thread(self._pushed.add, message, msg.missed)
            return
        await self._transport.respond(msg, await self._answer(self._commit(message)))

    async def _answer(self, work: Awaitable[tuple[int, int]]) -> ControlReply:
        """The reply to a control: (requests it ended, bytes it freed), or why it was refused."""
        began = time.perf_counter()
        try:
            num_aborted, freed = await work
        except Exception as exc:  # every control is answered: its caller waits for each scheduler
            if isinstance(exc, REFUSALS):
                log.warning("scheduler.control_refused", error=str(exc))
            else:
                log.exception("scheduler.control_failed")
            error = str(exc) if isinstance(exc, REFUSALS) else f"{type(exc).__name__}: {exc}"
            return ControlReply(self._id, ok=False, error=error[:4096], weight_version=self._core.controls.weight_version)
        seconds = time.perf_counter() - began
        version = self._core.controls.weight_version
        log.info("scheduler.control_done", weight_version=version, num_aborted=num_aborted, seconds=round(seconds, 3))
        return ControlReply(self._id, weight_version=version, num_aborted=num_aborted, freed_bytes=freed, seconds=seconds)

    async def _control(self, message: Control) -> tuple[int, int]:
        if isinstance(message, UpdateFromDisk):
            served = served_tensors(self._core.worker, message.target)
            tensors = await asyncio.to_thread(read_safetensors, message.model_path, served)
            return await self._swap(tensors, message.target, message.weight_version, message.abort_all_requests), 0
        if isinstance(message, PauseGeneration):
            return await self._between(lambda core: _pause(core, True, message.abort)), 0
        if isinstance(message, ContinueGeneration):
            return await self._between(lambda core: _pause(core, False, False)), 0
        if isinstance(message, ReleaseMemory):
            return await self._release(message.weights)
        return await self._between(self._resume), 0

    async def _commit(self, commit: WeightCommit) -> tuple[int, int]:
        tensors = self._pushed.take(commit)
        try:
            check_shapes(served_tensors(self._core.worker, commit.target), self._pushed.shapes(tensors))
            return await self._swap(tensors, commit.target, commit.weight_version, commit.abort_all_requests), 0
        finally:
            self._pushed.recycle()

    async def _swap(self, tensors: dict[str, torch.Tensor], target: WeightTarget, version: str | None, abort_all: bool) -> int:
        """Copy `tensors` in between two steps; with `abort_all`, every held request ends first,
        otherwise they all finish on the old weights while arrivals wait."""

        def swap(core: SchedulerCore) -> list[RequestOutput]:
            outputs = core.policy.fail_all(UPDATE_ABORT) if abort_all else []
            copy_weights(served_tensors(core.worker, target), tensors)
            self._num_updates += 1
            between_steps.weights_changed(core, version or str(self._num_updates))
            return outputs

        return await self._between(swap, drain=not abort_all)

    async def _release(self, weights: bool) -> tuple[int, int]:
        device = self._core.worker.runner.device
        self._pushed.drop_spare()
        before = memory.used_bytes(device)
        await self._between(lambda core: self._release_now(core, weights))
        return 0, before - memory.used_bytes(device)

    def _release_now(self, core: SchedulerCore, weights: bool) -> list[RequestOutput]:
        if self._released is not None:
            raise RuntimeError("memory is already released: resume_memory_occupation first")
        if core.policy.held():
            raise RuntimeError(f"{len(core.policy.held())} requests hold KV blocks: pause_generation with abort first")
        self._released = memory.release(core.worker, weights)
        core.policy.blocks.cache.flush()  # the released storage comes back zeroed: no cached block survives it
        core.controls.paused = True  # arrivals wait for resume
        return []

    def _resume(self, core: SchedulerCore) -> list[RequestOutput]:
        if self._released is None:
            raise RuntimeError("memory is not released")
        memory.resume(core.worker, self._released)
        self._released = None
        core.controls.paused = False
        return []

    async def _between(self, run: Callable[[SchedulerCore], list[RequestOutput]], drain: bool = False) -> int:
        done = self._core.controls.add(CoreControl(run, drain))
        self._wake()
        return await asyncio.wrap_future(done)


def _pause(core: SchedulerCore, paused: bool, abort: bool) -> list[RequestOutput]:
    core.controls.paused = paused
    return core.policy.fail_all(PAUSE_ABORT) if abort else []
