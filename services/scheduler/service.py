"""The scheduler's NATS adapter around `SchedulerCore`.

In: claims (queue group), generate requests (this instance's direct subject), aborts (broadcast),
pings (queue group). Out: one `TokenBatch` per detokenizer per step, heartbeats. A `StepThread`
runs `core.step` back to back in a thread of its own while the core has work, and the decode loop
publishes step N's outputs while step N + 1 runs there, so the network is never awaited inside a
step, the device waits neither for the network nor for the event loop between steps, and the event
loop never blocks on the model. The step thread runs at most one step ahead of what is published.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import structlog

from contracts import subjects
from contracts.detokenizer import Finish, FinishType, TokenBatch
from contracts.tokenizer import MAX_SUMMARY_HASHES, PrefixSummary
from services.common.arrays import to_wire
from contracts.scheduler import (
    AbortRequest,
    FlushCache,
    GenerateRequest,
    SchedulerClaim,
    SchedulerClaimReply,
    SchedulerInfo,
    SchedulerPing,
)
from services.common.heartbeat import HeartbeatPublisher
from services.common.lifecycle import wait_until
from services.common.memory import collections_since_start, settle_startup_heap
from services.common.logging import bound_request_id, request_id_from
from services.common.metrics_scheduler import SchedulerStats, SchedulerTelemetry
from services.common.nats_reader import Delivery
from services.common.transport import Traffic, Transport
from services.scheduler.between_steps import Control, flush_prefix_cache
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.request import RequestOutput, SchedulerRequest
from services.scheduler.step_loop import StepThread
from services.scheduler.step_trace import StepTrace
from services.scheduler.weights.control import SchedulerControls
from services.scheduler.wire import to_token_batches

log = structlog.get_logger(__name__)

SHUTDOWN_MESSAGE = "the scheduler is shutting down"
SUMMARY_REFRESH_S = 1.5  # an unchanged prefix summary is sent again this often (tokenizers drop one older than 3 s)


async def connect(config: SchedulerConfig) -> Transport:
    """The scheduler's NATS connection, subscribed to nothing: made before the model is loaded, so
    that a wrong password or an absent server fails in seconds, not after minutes of loading
    (`SchedulerService.run` joins the claim queue group only once there is a model to serve)."""
    return await Transport.connect(config.nats, f"scheduler-{config.instance_id}")


class SchedulerService:
    def __init__(self, config: SchedulerConfig, core: SchedulerCore) -> None:
        self._config = config
        self._core = core
        self._id = config.instance_id
        self._transport: Transport | None = None
        self._heartbeat: HeartbeatPublisher | None = None
        trace = StepTrace.open(config.step_trace, config.instance_id) if config.step_trace else None
        self._steps = StepThread(core, trace)
        self._controls = SchedulerControls(core, self._id, self._steps.wake)  # RL: weights, pauses, memory
        self._closing = False
        self._claims: dict[str, float] = {}  # rid -> monotonic deadline for its GenerateRequest
        self._claim_owners: dict[str, str] = {}  # rid -> detokenizer id, for claims that name one
        self._aborted_claims: dict[str, float] = {}  # aborted before arrival -> deadline
        self._queue_subscriptions: list[int] = []  # claim and ping: left first when draining
        self._telemetry = SchedulerTelemetry(self._stats, Path(config.model).name, traffic=self._traffic)

    def _traffic(self) -> Traffic | None:
        return None if self._transport is None else self._transport.events.traffic

    def _stats(self) -> SchedulerStats:
        core = self._core.stats()
        return SchedulerStats(
            num_running=core.num_running, num_waiting=core.num_waiting, kv_cache_usage=core.kv_usage,
            num_preemptions=core.num_preemptions, num_spec_draft_tokens=core.num_drafted_tokens,
            num_spec_accepted_tokens=core.num_accepted_tokens, num_prompt_tokens=core.num_prompt_tokens,
            num_generated_tokens=core.num_generated_tokens, num_spec_drafts=sum(core.accept_lengths),
            spec_accept_lengths=core.accept_lengths, forward_seconds=core.forward_s, draft_seconds=core.draft_s,
            num_prefix_cache_queries=core.num_prefix_queries, num_prefix_cache_hits=core.num_prefix_hits,
        )  # fmt: skip

    async def run(self, transport: Transport, stop: asyncio.Event) -> int:
        """Serve over `transport` (from `connect`; this service closes it) until `stop` is set (0)
        or a step fails (1)."""
        self._transport = transport
        await self._subscribe()
        await transport.flush()  # the SUBs went out on the receiving connection, beats go on the other: in effect first
        self._heartbeat = HeartbeatPublisher(
            self._transport, "scheduler", self._id, self._config.nats.heartbeat_interval_s, lambda: self._core.num_running
        )
        self._heartbeat.start()  # the first beat follows the subscriptions: it means "ready"
        await self._telemetry.start(self._config.metrics_host, self._config.metrics_port)
        decode = asyncio.create_task(self._decode_loop(), name="scheduler-decode")
        expiry = asyncio.create_task(self._expire_claims(), name="scheduler-claims")
        summaries = asyncio.create_task(self._publish_summaries(), name="scheduler-prefix-summary")
        log.info("scheduler.ready", instance=self._id, model=self._config.model)
        settle_startup_heap()
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({decode, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not decode.done():
            await self._drain(decode)
        expiry.cancel()
        summaries.cancel()
        return await self._shutdown(decode)

    async def _subscribe(self) -> None:
        transport = self._transport
        claims = await transport.subscribe(
            subjects.SCHEDULER_CLAIM, SchedulerClaim, self._on_claim, queue=subjects.SCHEDULER_QUEUE
        )
        await transport.subscribe(subjects.scheduler_generate(self._id), GenerateRequest, self._on_generate)
        await transport.subscribe(subjects.SCHEDULER_ABORT, AbortRequest, self._on_abort)
        pings = await transport.subscribe(subjects.SCHEDULER_PING, SchedulerPing, self._on_ping, queue=subjects.SCHEDULER_QUEUE)
        direct_claims = await transport.subscribe(subjects.scheduler_claim(self._id), SchedulerClaim, self._on_claim)
        await transport.subscribe(subjects.SCHEDULER_FLUSH_CACHE, FlushCache, self._on_flush_cache)
        await self._controls.subscribe(transport)
        self._queue_subscriptions = [claims, pings, direct_claims]

    async def _drain(self, decode: asyncio.Task[None]) -> None:
        """Leave without losing a token: leave the claim and ping queue groups (new requests go
        to the other schedulers), then keep stepping until every claimed request has arrived and
        finished, for at most `drain_timeout_s`. What is left then is failed by `_shutdown`."""
        for sid in self._queue_subscriptions:
            await self._transport.unsubscribe(sid)
        log.info("scheduler.draining", instance=self._id, num_running=self._core.num_running)
        finished = await wait_until(
            lambda: decode.done() or not (self._core.has_work() or self._claims), self._config.nats.drain_timeout_s
        )
        if not finished:
            log.warning("scheduler.drain_timeout", instance=self._id, num_running=self._core.num_running)

    # ---- handlers ----

    async def _on_claim(self, claim: SchedulerClaim, msg: Delivery) -> None:
        error = SHUTDOWN_MESSAGE if self._closing else self._core.claim_error(claim.num_prompt_tokens)
        num_choices = 1 + len(claim.choices)
        busy = error is None and not claim.force and not self._core.has_room(claim.num_prompt_tokens, len(self._claims), num_choices)
        if error is None and not busy:
            deadline = time.monotonic() + self._config.claim_expiry_s
            for rid, owner in _routes(claim):  # every choice: each can be aborted, or fail if the request is lost
                self._claims[rid] = deadline
                if owner:
                    self._claim_owners[rid] = owner
        reply = SchedulerClaimReply(self._id, accepted=error is None and not busy, error=error, busy=busy, forks=True)
        await self._transport.respond(msg, reply)

    async def _on_generate(self, request: GenerateRequest, msg: Delivery) -> None:
        with bound_request_id(request_id_from(msg.headers)):
            log.info("scheduler.request_added", rid=request.rid, prompt_tokens=request.input_ids.shape[0])
        routes = _routes(request)
        for rid, _ in routes:
            self._claims.pop(rid, None)
            self._claim_owners.pop(rid, None)
        # aborted between claim and arrival: the abort's sender already gave up on them
        aborted = [rid for rid, _ in routes if self._aborted_claims.pop(rid, None) is not None]
        if len(aborted) == len(routes):
            return
        scheduled = SchedulerRequest.from_generate(request)
        if scheduled.sampling.grammar is None:
            error = self._core.request_error(scheduled)
        else:  # its grammar compiles off the event loop (the first also loads xgrammar): heartbeats go on
            error = await asyncio.to_thread(self._core.request_error, scheduled)
        if error is not None:
            log.warning("scheduler.request_refused", rid=request.rid, error=error)
            finish = Finish(FinishType.ABORT, message=f"request refused: {error}")
            refusals = [RequestOutput(rid, owner, [], request.input_ids.shape[0], finish, None) for rid, owner in routes]
            await self._publish(refusals, self._core.num_steps)
            return
        self._core.add(scheduled)  # while closing, fail_all finishes it
        for rid in aborted:  # applied right after the add (the core drains adds, then aborts)
            self._core.abort(rid, "abort")
        self._steps.wake()

    async def _on_abort(self, abort: AbortRequest, _msg: Delivery) -> None:
        self._claim_owners.pop(abort.rid, None)
        if self._claims.pop(abort.rid, None) is not None:
            self._aborted_claims[abort.rid] = time.monotonic() + self._config.claim_expiry_s
            return
        self._abort(abort.rid, abort.reason)

    def _abort(self, rid: str, reason: str) -> None:
        self._core.abort(rid, reason)
        self._steps.wake()  # an abort is work: a drain waits until the core has applied it

    async def _on_ping(self, _ping: SchedulerPing, msg: Delivery) -> None:
        info = SchedulerInfo(
            scheduler_id=self._id,
            model_name=Path(self._config.model).name,
            max_model_len=self._core.max_model_len,
            vocab_size=self._core.vocab_size,
            speculative_algorithm=self._config.speculative_algorithm,
            num_running=self._core.num_running,
            weight_version=self._core.controls.weight_version,
        )
        await self._transport.respond(msg, info)

    async def _on_flush_cache(self, _flush: FlushCache, _msg: Delivery) -> None:
        self._core.controls.add(Control(flush_prefix_cache))  # between steps, like every control
        self._steps.wake()
        log.info("scheduler.prefix_cache_flushed", instance=self._id)

    async def _publish_summaries(self) -> None:
        """Cache-aware placement: what this scheduler caches, and its load, every interval (a
        tokenizer reads the latest and never waits for one)."""
        cache, sent_version, sent_at = self._core.policy.blocks.cache, -1, 0.0
        while cache.enabled:
            await asyncio.sleep(self._config.prefix_summary_interval_s)
            if cache.version == sent_version and time.monotonic() - sent_at < SUMMARY_REFRESH_S:
                continue  # unchanged: sent again only so often, to stay fresh at the tokenizers
            sent_version, sent_at = cache.version, time.monotonic()
            summary = PrefixSummary(self._id, cache.salt, cache.block_size, to_wire(cache.summary(MAX_SUMMARY_HASHES)),
                                    self._core.num_running + len(self._claims), self._core.policy.config.max_running_requests)  # fmt: skip
            try:
                await self._transport.publish(subjects.PREFIX_SUMMARY, summary)
            except Exception as exc:  # a summary lost is a hint lost: placement goes on without it
                log.warning("scheduler.prefix_summary_failed", error=repr(exc))

    async def _expire_claims(self) -> None:
        while True:
            await asyncio.sleep(self._config.claim_expiry_s / 4)
            now = time.monotonic()
            for table in (self._claims, self._aborted_claims):
                for rid in [rid for rid, deadline in table.items() if deadline < now]:
                    del table[rid]
            await self._fail_unarrived()

    async def _fail_unarrived(self) -> None:
        """Claims whose GenerateRequest never came (lost in transit) fail at their detokenizer:
        the client gets an error instead of waiting forever."""
        lost = [(rid, owner) for rid, owner in self._claim_owners.items() if rid not in self._claims]
        for rid, owner in lost:
            del self._claim_owners[rid]
            log.warning("scheduler.claim_expired", rid=rid, detokenizer=owner)
            message = "request failed: it never reached the scheduler (lost in transit)"
            await self._publish([RequestOutput(rid, owner, [], 0, Finish(FinishType.ABORT, message=message), None)],
                                self._core.num_steps)  # fmt: skip

    # ---- decode loop ----

    async def _decode_loop(self) -> None:
        """Publish each step's outputs, in step order, while the step thread runs the next step.
        It ends once `_shutdown` stopped the step thread and every step it finished is published
        (so the last batch goes out before the shutdown's fail_all and "dead" heartbeat), or with
        the error of a failed step, once the steps before it are published. Either way the step
        thread has stopped when it returns: no step runs during fail_all."""
        self._steps.start()
        try:
            while (result := await self._steps.next()) is not None:
                self._telemetry.observe_queue_times(result.queue_times)
                await self._publish(result.outputs, result.step, result.weight_version)
                self._steps.published()
        finally:
            await self._steps.stop()

    async def _publish(self, outputs: list[RequestOutput], step: int, weight_version: str | None = None) -> bool:
        """True when every destination's batch was published."""
        self._telemetry.observe_step(outputs)
        published = True
        for detokenizer_id, batch in to_token_batches(outputs, self._id, step, weight_version).items():
            published &= await self._publish_to(detokenizer_id, batch)
        return published

    async def _publish_to(self, detokenizer_id: str, batch: TokenBatch) -> bool:
        """A destination that cannot be published to (gone, refused) fails only its own requests:
        they are aborted, and the decode loop goes on for everyone else."""
        try:
            await self._transport.publish(subjects.detokenizer_tokens(detokenizer_id), batch)
        except Exception as exc:
            log.error("scheduler.publish_failed", detokenizer=detokenizer_id, error=repr(exc), rids=batch.rids[:8])
            for rid in batch.rids:
                self._abort(rid, "abort")
            return False
        return True

    # ---- shutdown ----

    async def _shutdown(self, decode: asyncio.Task[None]) -> int:
        self._closing = True
        await self._steps.stop()  # the running step finishes; the decode loop publishes what is left
        error = await _task_error(decode)
        if error is not None:
            log.error("scheduler.step_failed", error=error, exc_info=decode.exception())
        reason = f"scheduler step failed: {error}" if error is not None else SHUTDOWN_MESSAGE
        drained = await self._publish_last(reason)
        await self._heartbeat.stop(reason, drained=drained)
        await self._telemetry.close()
        await self._transport.close()
        log.info("scheduler.stopped", instance=self._id, reason=reason, gc_collections=collections_since_start())
        return 1 if error is not None else 0

    async def _publish_last(self, reason: str) -> bool:
        """Finish with `reason` whatever is still held: running and queued requests, and claims
        whose request never arrived. True when all of it was published: the dead sentinel then
        says `drained`, so dependents let these last batches (and the ones before, which the
        sentinel may overtake) arrive instead of failing the requests at once."""
        finish = Finish(FinishType.ABORT, message=reason)
        unarrived = [RequestOutput(rid, owner, [], 0, finish, None) for rid, owner in self._claim_owners.items()]
        ownerless = set(self._claims) - set(self._claim_owners)  # nobody to tell but the sentinel
        try:
            published = await self._publish(self._core.fail_all(reason) + unarrived, self._core.num_steps + 1)
        except Exception:
            log.exception("scheduler.last_publish_failed")
            return False
        return published and not ownerless and not self._core.has_work()


def _routes(message: SchedulerClaim | GenerateRequest) -> list[tuple[str, str | None]]:
    """(rid, detokenizer id) of every choice of a request: choice 0, then its forked choices."""
    return [(message.rid, message.detokenizer_id), *((c.rid, c.detokenizer_id) for c in message.choices)]


async def _task_error(task: asyncio.Task[None]) -> str | None:
    """Wait for the decode loop to leave its current step; its error in words, or None."""
    try:
        await task
    except asyncio.CancelledError:
        return None
    except Exception as exc:  # any failure of a step is fatal for this instance
        return f"{type(exc).__name__}: {exc}"
    return None
