"""Liveness over NATS: every service publishes `Heartbeat`s; whoever depends on one watches them.

A service that stops or hits a fatal error publishes `alive=False` (the "dead" sentinel), so
dependents fail fast; a service that is killed outright is noticed after `timeout_s` of silence.

A sentinel that says `drained` (the sender published the last message of everything it held) is
acted on only `timeout_s` later: a scheduler's last token batches reach a tokenizer through the
detokenizer, two hops, while its sentinel takes one and may overtake them. Failing its requests
at once would fail requests that are about to complete; after the grace, whatever is still
waiting on it fails as for any death (the last messages were lost).
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

    async def _send(self, alive: bool, reason: str | None = None, drained: bool = False) -> None:
        beat = Heartbeat(self._service, self._instance_id, alive, self._num_running(), reason, drained)
        with contextlib.suppress(Exception):
            await self._transport.publish(self._subject, beat)

    async def stop(self, reason: str, drained: bool = False) -> None:
        """Stop beating and publish the dead sentinel. `drained`: the last message of every
        request this instance held is already published (see the module docstring)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._send(alive=False, reason=reason, drained=drained)


class HeartbeatMonitor:
    """Tracks the instances of one service; calls `on_dead(instance_id, reason)` once per death:
    at a sentinel, after `timeout_s` of silence, or `timeout_s` after a drained sentinel."""

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
        self._leaving: dict[str, tuple[float, str]] = {}  # drained sentinel heard -> (dead from, reason)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._transport.subscribe(subjects.heartbeat(self._service), Heartbeat, self._on_beat)
        self._task = asyncio.create_task(self._watch())

    def is_alive(self, instance_id: str) -> bool:
        return instance_id in self._last_seen

    def is_gone(self, instance_id: str) -> bool:
        """Declared dead or never heard from: neither alive nor within a drained sentinel's grace."""
        return instance_id not in self._last_seen and instance_id not in self._leaving

    def alive_instances(self) -> list[str]:
        """Instances heard from within the timeout (and not declared dead since)."""
        return list(self._last_seen)

    async def _on_beat(self, beat: Heartbeat, _msg: Delivery) -> None:
        if beat.alive:
            if beat.instance_id in self._leaving:  # the id is back: its last incarnation is over
                self._declare_dead(beat.instance_id, self._leaving.pop(beat.instance_id)[1])
            self._last_seen[beat.instance_id] = time.monotonic()
        else:
            self._on_sentinel(beat)

    def _on_sentinel(self, beat: Heartbeat) -> None:
        reason = beat.reason or f"{self._service} stopped"
        self._last_seen.pop(beat.instance_id, None)
        if beat.drained:  # its last messages may still be on a longer path than this one
            log.info("heartbeat.leaving", service=self._service, instance=beat.instance_id, grace_s=self._timeout_s)
            self._leaving.setdefault(beat.instance_id, (time.monotonic() + self._timeout_s, reason))
        else:
            self._leaving.pop(beat.instance_id, None)
            self._declare_dead(beat.instance_id, reason)

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
            for instance_id, (dead_from, reason) in list(self._leaving.items()):
                if now >= dead_from:
                    del self._leaving[instance_id]
                    self._declare_dead(instance_id, reason)

    def _declare_dead(self, instance_id: str, reason: str) -> None:
        log.warning("heartbeat.dead", service=self._service, instance=instance_id, reason=reason)
        self._on_dead(instance_id, reason)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
