"""NATS side of the tokenizer: claim a detokenizer and a scheduler, submit, receive text batches.

Steps 2-4 and 9-10 of docs/architecture.md. Death of a scheduler or detokenizer is learned from
heartbeats (dead sentinel, or silence longer than `heartbeat_timeout_s`), never from a
per-request timeout, so a request owned by a dead instance fails within about one timeout. A
drained sentinel takes effect one timeout late (`HeartbeatMonitor`): the leaver's last outputs,
already published, finish its requests first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable

import nats.errors
import structlog

from contracts import subjects
from contracts.scheduler import AbortRequest, SchedulerInfo, SchedulerPing
from contracts.tokenizer import PrefixSummary, TextBatch
from contracts.weights import Control, ControlReply
from services.common.heartbeat import HeartbeatMonitor, HeartbeatPublisher
from services.common.nats_reader import Delivery
from services.common.receive import remember_sender
from services.common.transport import Traffic, Transport
from services.tokenizer.config import TokenizerConfig
from services.common.logging import request_headers
from services.tokenizer.placement import Placement, ServiceUnavailable, generate_request
from services.tokenizer.requests import OnDone, PendingRequest, PendingRequests
from services.tokenizer.validation import GenerationSpec

log = structlog.get_logger(__name__)


__all__ = ["ServiceUnavailable", "TokenizerService"]


class TokenizerService:
    def __init__(self, config: TokenizerConfig, transport: Transport, on_done: OnDone | None = None) -> None:
        self.config = config
        self.pending = PendingRequests(on_done)
        self._transport = transport
        self._heartbeat = HeartbeatPublisher(
            transport, "tokenizer", config.instance_id, config.nats.heartbeat_interval_s, lambda: len(self.pending)
        )
        timeout = config.nats.heartbeat_timeout_s
        self._schedulers = HeartbeatMonitor(transport, "scheduler", timeout, self._on_dead)
        self._detokenizers = HeartbeatMonitor(transport, "detokenizer", timeout, self._on_dead)
        self.placement = Placement(config, transport)  # which scheduler a request goes to; /flush_cache
        self._watchdog: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._detokenizers_by_sender: OrderedDict[str, str] = OrderedDict()  # Sw-Seq sender -> detokenizer id
        transport.on_receive_loss(lambda: self._fail_lost(lambda _p: True, "the tokenizer lost its NATS connection mid-request"))

    @classmethod
    async def start(cls, config: TokenizerConfig, on_done: OnDone | None = None) -> TokenizerService:
        """`on_done` sees every request once, when it leaves (metrics, the summary line)."""
        transport = await Transport.connect(config.nats, f"tokenizer-{config.instance_id}")
        service = cls(config, transport, on_done)
        outputs = subjects.tokenizer_outputs(config.instance_id)
        await transport.subscribe(outputs, TextBatch, service._on_outputs, on_gap=service._on_outputs_lost)
        await transport.subscribe(subjects.PREFIX_SUMMARY, PrefixSummary, service.placement.on_summary)
        await service._schedulers.start()
        await service._detokenizers.start()
        await transport.flush()  # the SUBs went out on the receiving connection, beats go on the other: in effect first
        service._heartbeat.start()
        service._watchdog = asyncio.create_task(service._watch_unseen())
        return service

    @property
    def traffic(self) -> Traffic:
        """What crossed this service's NATS transport (metrics)."""
        return self._transport.events.traffic

    async def close(self, reason: str = "tokenizer stopped") -> None:
        self.pending.fail(lambda _p: True, reason)
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self._schedulers.stop()
        await self._detokenizers.stop()
        await self._heartbeat.stop(reason)
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._transport.close()

    async def submit(self, spec: GenerationSpec) -> PendingRequest:
        """Register with a detokenizer, claim a scheduler, publish the request. The returned
        request receives its deltas; raises `ServiceUnavailable` or `InvalidRequest`."""
        return (await self.submit_choices([spec]))[0]

    async def submit_choices(self, specs: list[GenerationSpec]) -> list[PendingRequest]:
        """The choices of one prompt (`n` > 1: the same prompt and parameters, their own seeds):
        each registers with a detokenizer; one claim names them all, and a scheduler that forks
        them (reply `forks`) gets one GenerateRequest and computes the prompt once. An older one
        gets choice 0, and the others are claimed and sent as requests of their own."""
        pendings = [self.pending.add(spec) for spec in specs]
        try:
            await self.placement.register_all(pendings)
            reply = await self.placement.claim(pendings[0], pendings[1:])
            together = pendings if reply.forks else pendings[:1]
            await self._send(reply.scheduler_id, together)
            for pending in pendings[len(together) :]:
                await self._send((await self.placement.claim(pending, [])).scheduler_id, [pending])
        except BaseException:
            for pending in pendings:
                self.pending.remove(pending.rid, outcome=None)
                if pending.detokenizer_id:
                    self._spawn(self._publish_abort(pending.rid, pending.spec.request_id))
            raise
        return pendings

    async def _send(self, scheduler_id: str, pendings: list[PendingRequest]) -> None:
        """Publish one GenerateRequest for `pendings` (choice 0, then its forked choices)."""
        for pending in pendings:
            pending.scheduler_id = scheduler_id
        headers = request_headers(pendings[0].spec.request_id)
        await self._transport.publish(subjects.scheduler_generate(scheduler_id), generate_request(pendings), headers)
        now = time.monotonic()
        for pending in pendings:
            pending.timing.submitted_at = now

    async def abort(self, rid: str) -> None:
        """The client went away: stop generating (the scheduler frees the slot)."""
        pending = self.pending.remove(rid)
        if pending is not None:
            await self._publish_abort(rid, pending.spec.request_id)

    async def ping(self) -> SchedulerInfo | None:
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            return await self._transport.request(
                subjects.SCHEDULER_PING, SchedulerPing(time.time()), SchedulerInfo, self.config.health_timeout_s
            )
        return None

    async def control(self, message: Control, timeout_s: float) -> dict[str, ControlReply | str]:
        """Send `message` to every live scheduler at once: scheduler id -> its reply, or why none came."""

        async def ask(scheduler_id: str) -> ControlReply | str:
            subject = subjects.scheduler_control(scheduler_id)
            try:
                return await self._transport.request(subject, message, ControlReply, timeout_s)
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                return f"no answer: {type(exc).__name__}"

        ids = self._schedulers.alive_instances()
        return dict(zip(ids, await asyncio.gather(*(ask(scheduler_id) for scheduler_id in ids)), strict=True))

    @property
    def is_connected(self) -> bool:
        return self._transport.is_connected

    def liveness(self) -> dict[str, list[str]]:
        """The live instances of each service this tokenizer depends on, from their heartbeats."""
        return {"scheduler": self._schedulers.alive_instances(), "detokenizer": self._detokenizers.alive_instances()}

    async def _on_outputs(self, batch: TextBatch, msg: Delivery) -> None:
        remember_sender(self._detokenizers_by_sender, msg, batch.detokenizer_id)
        if msg.missed:  # text batches of this detokenizer were lost: its requests may be short
            self._fail_lost(lambda p: p.detokenizer_id == batch.detokenizer_id,
                            f"{msg.missed} text batches from detokenizer {batch.detokenizer_id} were lost in transit")  # fmt: skip
        self.pending.dispatch(batch)

    def _on_outputs_lost(self, sender: str) -> None:
        if (detokenizer_id := self._detokenizers_by_sender.get(sender)) is not None:
            self._fail_lost(lambda p: p.detokenizer_id == detokenizer_id, f"text batches from detokenizer {detokenizer_id} were lost in transit")

    def _fail_lost(self, select: Callable[[PendingRequest], bool], why: str) -> None:
        """Fail (and abort) requests whose outputs may be lost: never a short answer as complete."""
        failed = self.pending.fail(select, f"request failed: {why}")
        if failed:
            log.error("tokenizer.outputs_lost", reason=why, num_failed=len(failed))
        for rid in failed:
            self._spawn(self._publish_abort(rid))

    def _on_dead(self, instance_id: str, reason: str) -> None:
        for rid in self.pending.fail_owned_by(instance_id, f"request failed: {reason}"):
            self._spawn(self._publish_abort(rid))

    async def _watch_unseen(self) -> None:
        """Requests owned by an instance never heard from (or already declared dead) also fail."""
        timeout = self.config.nats.heartbeat_timeout_s
        while True:
            await asyncio.sleep(timeout / 4)
            cutoff = time.monotonic() - timeout
            failed = self.pending.fail(
                lambda p: p.timing.arrived_at < cutoff and self._silent_owner(p),
                "request failed: its scheduler or detokenizer sends no heartbeat",
            )
            for rid in failed:
                self._spawn(self._publish_abort(rid))

    def _silent_owner(self, pending: PendingRequest) -> bool:
        scheduler_gone = bool(pending.scheduler_id) and self._schedulers.is_gone(pending.scheduler_id)
        detokenizer_gone = bool(pending.detokenizer_id) and self._detokenizers.is_gone(pending.detokenizer_id)
        return scheduler_gone or detokenizer_gone

    async def _publish_abort(self, rid: str, request_id: str = "") -> None:
        with contextlib.suppress(Exception):
            await self._transport.publish(subjects.SCHEDULER_ABORT, AbortRequest(rid, "abort"), request_headers(request_id))

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
