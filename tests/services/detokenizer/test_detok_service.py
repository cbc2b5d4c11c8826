"""The detokenizer service alone over a real nats-server: this test plays tokenizer and scheduler."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import numpy as np
import pytest

from contracts import subjects
from contracts.control import Heartbeat
from contracts.detokenizer import (
    DetokenizeParams,
    DetokenizerRegistration,
    DetokenizerRegistrationReply,
    Finish,
    FinishType,
)
from contracts.scheduler import AbortRequest
from contracts.tokenizer import TextBatch
from services.common.arrays import from_wire, to_wire
from services.common.logprob_rows import RequestLogprobs, RowLogprobs, from_columns
from services.common.connection import NatsConnection
from services.common.nats_reader import Delivery
from services.common.transport import Transport
from services.detokenizer.config import DetokenizerConfig
from services.detokenizer.service import DetokenizerService
from tests.services.detokenizer.conftest import token_batch

DETOK_ID = "detok-test"


class Inbox:
    """Collects every message of one type on one subject."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    async def handler(self, message, _msg: Delivery) -> None:
        self.queue.put_nowait(message)

    async def get(self, timeout: float = 10.0):
        return await asyncio.wait_for(self.queue.get(), timeout)


@asynccontextmanager
async def running_detokenizer(url: str, tokenizer_path):
    """Start the service and wait for a heartbeat: beats start after its subscriptions are live."""
    client = await Transport.connect(url, "test-client")
    beats = Inbox()
    await client.subscribe(subjects.heartbeat("detokenizer"), Heartbeat, beats.handler)
    config = DetokenizerConfig(NatsConnection(nats_url=url, heartbeat_interval_s=0.2), tokenizer_path, instance_id=DETOK_ID)
    service = await DetokenizerService.start(config)
    try:
        beat = await beats.get()
        assert beat.instance_id == DETOK_ID and beat.alive
        yield client, beats
    finally:
        await service.close()
        await client.close()


async def register(client: Transport, rid: str, tokenizer_id: str, stop: tuple[str, ...] = ()) -> None:
    registration = DetokenizerRegistration(rid=rid, tokenizer_id=tokenizer_id, params=DetokenizeParams(stop=stop))
    reply = await client.request(subjects.DETOKENIZER_REGISTER, registration, DetokenizerRegistrationReply, 5)
    assert reply.detokenizer_id == DETOK_ID


@pytest.mark.timeout(30)
async def test_service_detokenizes_routes_and_aborts_on_stop(nats_server, tokenizer, tokenizer_path):
    async with running_detokenizer(nats_server.url, tokenizer_path) as (client, beats):
        outputs_a, outputs_b, aborts = Inbox(), Inbox(), Inbox()
        await client.subscribe(subjects.tokenizer_outputs("tok-A"), TextBatch, outputs_a.handler)
        await client.subscribe(subjects.tokenizer_outputs("tok-B"), TextBatch, outputs_b.handler)
        await client.subscribe(subjects.SCHEDULER_ABORT, AbortRequest, aborts.handler)
        await register(client, "r1", "tok-A", stop=("STOPHERE",))
        await register(client, "r2", "tok-B")
        ids1 = tokenizer.encode("first STOPHERE never seen").ids
        ids2 = tokenizer.encode("second 你好").ids
        batch = token_batch([("r1", ids1, None), ("r2", ids2, Finish(FinishType.LENGTH))])
        await client.publish(subjects.detokenizer_tokens(DETOK_ID), batch)

        out_a, out_b = await outputs_a.get(), await outputs_b.get()
        assert (out_a.rids, out_a.text_deltas) == (["r1"], ["first "])
        assert out_a.finish == [Finish(FinishType.STOP, matched="STOPHERE")]
        assert len(from_wire(out_a.new_token_ids)) < len(ids1)
        assert (out_b.rids, out_b.text_deltas, out_b.finish) == (["r2"], ["second 你好"], [Finish(FinishType.LENGTH)])
        assert from_wire(out_b.new_token_ids).tolist() == ids2
        assert await aborts.get() == AbortRequest(rid="r1", reason="stop")

        beat = await beats.get()
        while beat.num_running != 0:
            beat = await beats.get()


@pytest.mark.timeout(60)
async def test_21mb_flat_prompt_logprobs_pass_through_1mb_server(nats_server_factory, tokenizer, tokenizer_path):
    server = nats_server_factory(max_payload="1MB")
    rows, k = 131072, 20
    rng = np.random.default_rng(0)
    values = -rng.random((rows, k), dtype=np.float32)  # [rows, k]
    ids = rng.integers(0, 2048, (rows, k), dtype=np.int32)  # [rows, k]
    async with running_detokenizer(server.url, tokenizer_path) as (client, _beats):
        assert client.max_payload == 1024 * 1024
        outputs = Inbox()
        await client.subscribe(subjects.tokenizer_outputs("tok-A"), TextBatch, outputs.handler)
        await register(client, "big", "tok-A")
        logprobs = RequestLogprobs(flat=RowLogprobs.of(None, values, ids, start=1))
        first_ids = tokenizer.encode("ok").ids
        batch = token_batch([("big", first_ids, None)], logprobs=[logprobs])
        await client.publish(subjects.detokenizer_tokens(DETOK_ID), batch)
        out = await outputs.get(timeout=40)
        (received,) = from_columns(out.prompt_top_flat, 1)
        np.testing.assert_array_equal(received.top_values, values)
        np.testing.assert_array_equal(received.top_ids, ids)
        assert received.start == 1
        assert out.text_deltas == ["ok"]


async def wait_for_num_running(beats: Inbox, expected: int) -> None:
    while (await beats.get()).num_running != expected:
        pass


@pytest.mark.timeout(30)
async def test_dead_scheduler_sentinel_drops_its_requests(nats_server, tokenizer, tokenizer_path):
    async with running_detokenizer(nats_server.url, tokenizer_path) as (client, beats):
        await register(client, "r", "tok-A")
        await client.publish(subjects.detokenizer_tokens(DETOK_ID), token_batch([("r", [40, 41], None)]))
        await wait_for_num_running(beats, 1)
        await client.publish(subjects.heartbeat("scheduler"), Heartbeat("scheduler", "sched-1", alive=False))
        await wait_for_num_running(beats, 0)
