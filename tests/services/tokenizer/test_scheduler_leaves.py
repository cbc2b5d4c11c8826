"""A scheduler that drains and leaves must not have its finished requests failed (PRODUCT §6).

Its "dead" sentinel travels one hop (scheduler -> tokenizer) while its last token batches travel
two (scheduler -> detokenizer -> tokenizer), so the sentinel can arrive first. Here the real
tokenizer and detokenizer services run in-process over a real nats-server, a stand-in scheduler
plays a request's steps and leaves, and the detokenizer holds the final batch until both
services have heard the sentinel: the overtaking happens every time, not by chance."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from contracts import subjects
from contracts.detokenizer import Finish, FinishType
from contracts.scheduler import GenerateRequest, SchedulerClaim, SchedulerClaimReply, SchedulerInfo, SchedulerPing
from services.common.connection import NatsConnection
from services.common.heartbeat import HeartbeatPublisher
from services.common.lifecycle import wait_until
from services.common.transport import Transport
from services.detokenizer.config import DetokenizerConfig, tokenizer_file
from services.detokenizer.service import DetokenizerService
from tests.services.detokenizer.conftest import token_batch
from tests.services.tokenizer.conftest import MODEL_DIR, base_url, wait_live

pytestmark = pytest.mark.timeout(60)

LEAVING = "sched-leaving"
LONG_S = 30.0  # a heartbeat timeout no test waits for: nobody is declared dead by silence here


@dataclass
class LeavingScheduler:
    """Takes every claim, records what arrives, beats, and leaves when told (saying `drained`)."""

    transport: Transport
    heartbeat: HeartbeatPublisher
    requests: asyncio.Queue[GenerateRequest] = field(default_factory=asyncio.Queue)

    async def start(self) -> None:
        t = self.transport
        await t.subscribe(subjects.SCHEDULER_CLAIM, SchedulerClaim, self._on_claim, queue=subjects.SCHEDULER_QUEUE)
        await t.subscribe(subjects.scheduler_generate(LEAVING), GenerateRequest, self._on_generate)
        await t.subscribe(subjects.SCHEDULER_PING, SchedulerPing, self._on_ping, queue=subjects.SCHEDULER_QUEUE)
        await t.flush()
        self.heartbeat.start()

    async def _on_claim(self, _claim: SchedulerClaim, msg) -> None:
        await self.transport.respond(msg, SchedulerClaimReply(LEAVING, True))

    async def _on_generate(self, request: GenerateRequest, _msg) -> None:
        self.requests.put_nowait(request)

    async def _on_ping(self, _ping: SchedulerPing, msg) -> None:
        await self.transport.respond(msg, SchedulerInfo(LEAVING, "sparkwire-tiny", 32768, 2048))

    async def step(self, request: GenerateRequest, ids: list[int], finish: Finish | None) -> None:
        batch = token_batch([(request.rid, ids, finish)], scheduler_id=LEAVING)
        await self.transport.publish(subjects.detokenizer_tokens(request.detokenizer_id), batch)

    async def leave(self, drained: bool) -> None:
        await self.heartbeat.stop("the scheduler is shutting down", drained=drained)


@contextlib.asynccontextmanager
async def stack(start_tokenizer, url: str, timeout_s: float, final_held: asyncio.Event, monkeypatch) -> AsyncIterator:
    """(tokenizer frontend, detokenizer service, scheduler): the detokenizer handles a batch that
    finishes a request only once `final_held` is set."""
    handle = DetokenizerService._on_tokens

    async def held_until_released(self, batch, msg) -> None:
        if any(finish is not None for finish in batch.finish):
            await final_held.wait()
        await handle(self, batch, msg)

    monkeypatch.setattr(DetokenizerService, "_on_tokens", held_until_released)
    connection = NatsConnection(nats_url=url, heartbeat_interval_s=0.2, heartbeat_timeout_s=timeout_s)
    detokenizer = await DetokenizerService.start(DetokenizerConfig(connection, tokenizer_file(MODEL_DIR), "detok-1"))
    transport = await Transport.connect(url, "leaving-scheduler")
    scheduler = LeavingScheduler(transport, HeartbeatPublisher(transport, "scheduler", LEAVING, 0.2))
    await scheduler.start()
    try:
        async with start_tokenizer(nats=connection) as frontend:
            await wait_live(frontend)
            yield frontend, detokenizer, scheduler
    finally:
        final_held.set()
        await detokenizer.close()
        await transport.close()


async def sse_events(client: httpx.AsyncClient, url: str, body: dict, first: asyncio.Event) -> list[dict]:
    events = []
    async with client.stream("POST", f"{url}/generate", json=body | {"stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
                first.set()
    return events


async def stream_first_tokens(
    client: httpx.AsyncClient, frontend, sched: LeavingScheduler
) -> tuple[asyncio.Task[list[dict]], GenerateRequest]:
    """A streamed /generate whose first two tokens the stand-in scheduler sent and the client got:
    the detokenizer holds the request as this scheduler's now. Returns the stream's task."""
    first = asyncio.Event()
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 3}}
    streaming = asyncio.create_task(sse_events(client, base_url(frontend), body, first))
    request = await asyncio.wait_for(sched.requests.get(), 10)
    await sched.step(request, [40, 41], None)
    await first.wait()
    return streaming, request


async def test_a_drained_schedulers_last_batch_still_finishes_its_request(start_tokenizer, nats_server, monkeypatch):
    final_held = asyncio.Event()
    async with stack(start_tokenizer, nats_server.url, LONG_S, final_held, monkeypatch) as (frontend, detok, sched):
        async with httpx.AsyncClient(timeout=30) as client:
            streaming, request = await stream_first_tokens(client, frontend, sched)
            await sched.step(request, [42], Finish(FinishType.LENGTH))  # held at the detokenizer
            await sched.leave(drained=True)
            # Both services heard the sentinel before the last batch is let through.
            assert await wait_until(lambda: LEAVING not in frontend.service.liveness()["scheduler"], 10.0)
            assert await wait_until(lambda: LEAVING not in detok._schedulers.alive_instances(), 10.0)
            final_held.set()
            events = await streaming
    last = events[-1]
    assert "error" not in last, last
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["output_ids"] == [40, 41, 42]


async def test_a_drained_scheduler_whose_last_batch_never_comes_fails_its_request_after_the_grace(
    start_tokenizer, nats_server, monkeypatch
):
    """The grace (one heartbeat timeout) is a backstop: a request is never left hanging."""
    async with stack(start_tokenizer, nats_server.url, 1.0, asyncio.Event(), monkeypatch) as (frontend, _detok, sched):
        async with httpx.AsyncClient(timeout=30) as client:
            streaming, _request = await stream_first_tokens(client, frontend, sched)
            await sched.leave(drained=True)  # but the final batch was lost
            events = await streaming
    assert "error" in events[-1]
    assert "shutting down" in events[-1]["error"]["message"]
