"""The detokenizer's NATS adapter: registrations and token batches in, text batches and stop
aborts out. All the work is in `DetokenizerCore`."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

import structlog
from tokenizers import Tokenizer

from contracts import subjects
from contracts.scheduler import AbortRequest
from contracts.detokenizer import DetokenizerRegistration, DetokenizerRegistrationReply, TokenBatch
from contracts.tokenizer import TextBatch
from services.common.heartbeat import HeartbeatMonitor, HeartbeatPublisher
from services.common.lifecycle import wait_until
from services.common.memory import settle_startup_heap
from services.common.logging import request_id_from
from services.common.nats_reader import Delivery
from services.common.receive import remember_sender
from services.common.transport import Transport
from services.detokenizer.config import DetokenizerConfig
from services.detokenizer.core import DetokenizeResult, DetokenizerCore
from services.detokenizer.metrics import DetokenizerTelemetry

log = structlog.get_logger(__name__)

SERVICE = "detokenizer"


class DetokenizerService:
    def __init__(self, config: DetokenizerConfig, transport: Transport, core: DetokenizerCore) -> None:
        self._config = config
        self._transport = transport
        self._core = core
        self._heartbeat = HeartbeatPublisher(
            transport, SERVICE, config.instance_id, config.nats.heartbeat_interval_s, lambda: core.num_running
        )
        self._schedulers = HeartbeatMonitor(transport, "scheduler", config.nats.heartbeat_timeout_s, self._on_scheduler_dead)
        self._register_sid: int | None = None
        self.telemetry = DetokenizerTelemetry(lambda: core.num_running, lambda: transport.events.traffic)
        self._background: set[asyncio.Task[None]] = set()
        self._schedulers_by_sender: OrderedDict[str, str] = OrderedDict()  # Sw-Seq sender -> scheduler id
        transport.on_receive_loss(self._on_receive_loss)

    @classmethod
    async def start(cls, config: DetokenizerConfig) -> DetokenizerService:
        """Connect, subscribe, then beat: the first heartbeat means the subscriptions are live (a
        round trip on both connections after the SUBs: subscriptions and beats travel on different ones)."""
        core = DetokenizerCore(Tokenizer.from_file(str(config.tokenizer_path)), config.instance_id)
        transport = await Transport.connect(config.nats, f"{SERVICE}-{config.instance_id}")
        service = cls(config, transport, core)
        service._register_sid = await transport.subscribe(
            subjects.DETOKENIZER_REGISTER,
            DetokenizerRegistration,
            service._on_register,
            queue=subjects.DETOKENIZER_QUEUE,
        )
        tokens = subjects.detokenizer_tokens(config.instance_id)
        await transport.subscribe(tokens, TokenBatch, service._on_tokens, on_gap=service._on_tokens_lost)
        await transport.subscribe(subjects.SCHEDULER_ABORT, AbortRequest, service._on_abort)
        await service._schedulers.start()
        await transport.flush()  # the SUBs went out on the receiving connection, beats go on the other: in effect first
        service._heartbeat.start()
        await service.telemetry.start(config.metrics_host, config.metrics_port)
        log.info("detokenizer.started", instance=config.instance_id, nats=config.nats.redacted_url)
        return service

    async def _on_register(self, registration: DetokenizerRegistration, msg: Delivery) -> None:
        self._core.register(registration)
        self.telemetry.registered(registration.rid, request_id_from(msg.headers))
        await self._transport.respond(msg, DetokenizerRegistrationReply(detokenizer_id=self._config.instance_id))

    async def _on_tokens(self, batch: TokenBatch, msg: Delivery) -> None:
        remember_sender(self._schedulers_by_sender, msg, batch.scheduler_id)
        if msg.missed:  # batches of this scheduler were lost: whoever they carried tokens for is short
            message = f"request failed: {msg.missed} token batches from scheduler {batch.scheduler_id} were lost in transit"
            await self._send(self._fail(self._core.rids_from(batch.scheduler_id, batch), message))
        result = self._core.process(batch)
        self.telemetry.processed(batch, result.outputs.values(), len(result.aborts))
        await self._send(result)

    def _fail(self, rids: list[str], message: str) -> DetokenizeResult:
        result = self._core.fail(rids, message)
        self.telemetry.forgotten([abort.rid for abort in result.aborts])
        return result

    def _on_tokens_lost(self, sender: str) -> None:
        """A scheduler's last batches to us were lost (its connection came back and said how many
        it had sent): its requests here will get no more tokens."""
        scheduler_id = self._schedulers_by_sender.get(sender)
        if scheduler_id is not None:
            message = f"request failed: token batches from scheduler {scheduler_id} were lost in transit"
            self._spawn(self._send(self._fail(self._core.rids_from(scheduler_id), message)))

    def _on_receive_loss(self) -> None:
        """Our receiving connection dropped and came back: any batch sent meanwhile is gone."""
        rids = self._core.held_rids
        if rids:
            log.error("detokenizer.receive_loss", num_failed=len(rids))
            result = self._fail(rids, "request failed: the detokenizer lost its NATS connection mid-stream")
            self._spawn(self._send(result))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send(self, result: DetokenizeResult) -> None:
        # Aborts first: the sooner the scheduler hears of a stop match, the fewer wasted steps.
        for abort in result.aborts:
            await self._publish(subjects.SCHEDULER_ABORT, abort, [abort.rid])
        for tokenizer_id, text_batch in result.outputs.items():
            await self._publish(subjects.tokenizer_outputs(tokenizer_id), text_batch, text_batch.rids)

    async def _publish(self, subject: str, message: TextBatch | AbortRequest, rids: list[str]) -> None:
        """One destination that cannot be published to never stops the others' outputs."""
        try:
            await self._transport.publish(subject, message)
        except Exception as exc:
            log.error("detokenizer.publish_failed", subject=subject, error=repr(exc), rids=rids[:8])

    async def _on_abort(self, abort: AbortRequest, _msg: Delivery) -> None:
        if abort.reason != "stop" and self._core.forget_unstarted(abort.rid):
            self.telemetry.forgotten([abort.rid])
            log.info("detokenizer.unstarted_request_dropped", rid=abort.rid, reason=abort.reason)

    def _on_scheduler_dead(self, scheduler_id: str, reason: str) -> None:
        dropped = self._core.forget_scheduler(scheduler_id)
        self.telemetry.forgotten(dropped)
        if dropped:
            log.warning("detokenizer.scheduler_dead", scheduler=scheduler_id, reason=reason, num_dropped=len(dropped))

    async def drain(self) -> bool:
        """Leave without losing a token: take no new registrations (the queue group sends them to
        the other replicas), then keep detokenizing until every request we hold has finished, for
        at most `drain_timeout_s`. True when it finished (the dead sentinel then says `drained`)."""
        if self._register_sid is not None:
            await self._transport.unsubscribe(self._register_sid)
            self._register_sid = None
        log.info("detokenizer.draining", instance=self._config.instance_id, num_running=self._core.num_running)
        if not await wait_until(lambda: self._core.num_running == 0, self._config.nats.drain_timeout_s):
            log.warning("detokenizer.drain_timeout", instance=self._config.instance_id, num_running=self._core.num_running)
            return False
        return True

    async def close(self, reason: str = "shutdown", drained: bool = False) -> None:
        """Say "dead" first so tokenizers fail what we still hold fast (or, `drained`, let our
        last text batches arrive first), then close."""
        await self._heartbeat.stop(reason, drained=drained)
        await self._schedulers.stop()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.telemetry.close()
        await self._transport.close()
        log.info("detokenizer.stopped", instance=self._config.instance_id, reason=reason)


async def run(config: DetokenizerConfig, stop: asyncio.Event) -> None:
    service = await DetokenizerService.start(config)
    settle_startup_heap()
    drained = False
    try:
        await stop.wait()
        drained = await service.drain()
    finally:
        await service.close(drained=drained)
