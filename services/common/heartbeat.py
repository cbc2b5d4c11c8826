"""Liveness over NATS: every service publishes `Heartbeat`s; whoever depends on one watches them.

A service that stops or hits a fatal error publishes `alive=False` (the "dead" sentinel), so
dependents fail fast; a service that is killed outright is noticed after `timeout_s` of silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog

from contracts import subjects
from contracts.control import Heartbeat
from services.common.nats_reader import Delivery
from services.common.transport import Transport

log = structlog.get_logger(__name__)


class HeartbeatPublisher:
    def __init__(
        self,
        transport: Transport,
        service: str,
        instance_id: str,
        interval_s: float,
        num_running: Callable[[], int] = lambda: 0,
    ) -> None:
        self._transport = transport
        self._subject = subjects.heartbeat(service)
        self._service = service
        self._instance_id = instance_id
        self._interval_s = interval_s
        self._num_running = num_running
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            await self._send(alive=True)
            await asyncio.sleep(self._interval_s)

    async def _send(self, alive: bool, reason: str | None = None) -> None:
        beat = Heartbeat(self._service, self._instance_id, alive, self._num_running(), reason)
        with contextlib.suppress(Exception):
            await self._transport.publish(self._subject, beat)

    async def stop(self, reason: str) -> None:
        """Stop beating and publish the dead sentinel."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._send(alive=False, reason=reason)


class HeartbeatMonitor:
    """Tracks the instances of one service; calls `on_dead(instance_id, reason)` once per death."""

    def __init__(
        self,
        transport: Transport,
        service: str,
        timeout_s: float,
        on_dead: Callable[[str, str], None],
    ) -> None:
        self._transport = transport
        self._service = service
        self._timeout_s = timeout_s
        self._on_dead = on_dead
        self._last_seen: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._transport.subscribe(subjects.heartbeat(self._service), Heartbeat, self._on_beat)
        self._task = asyncio.create_task(self._watch())

    def is_alive(self, instance_id: str) -> bool:
        return instance_id in self._last_seen

    def alive_instances(self) -> list[str]:
        """Instances heard from within the timeout (and not declared dead since)."""
        return list(self._last_seen)

    async def _on_beat(self, beat: Heartbeat, _msg: Delivery) -> None:
        if beat.alive:
            self._last_seen[beat.instance_id] = time.monotonic()
        else:
            self._last_seen.pop(beat.instance_id, None)
            self._declare_dead(beat.instance_id, beat.reason or f"{self._service} stopped")

    async def _watch(self) -> None:
        period = self._timeout_s / 4
        while True:
            before = time.monotonic()
            await asyncio.sleep(period)
            now = time.monotonic()
            if now - before > 2 * period:
                # Our own loop was blocked: heartbeats that arrived meanwhile are still queued
                # behind this wake-up. Judge silence only after they have been read.
                continue
            for instance_id, seen in list(self._last_seen.items()):
                if now - seen > self._timeout_s:
                    del self._last_seen[instance_id]
                    self._declare_dead(instance_id, f"{self._service} {instance_id} silent for {self._timeout_s}s")

    def _declare_dead(self, instance_id: str, reason: str) -> None:
        log.warning("heartbeat.dead", service=self._service, instance=instance_id, reason=reason)
        self._on_dead(instance_id, reason)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
