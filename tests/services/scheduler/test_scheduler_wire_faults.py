"""Nothing from the wire is fatal to the scheduler: a hostile GenerateRequest is dropped at the
decoder, and a destination that cannot be published to fails only its own requests."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import numpy as np
import pytest

from contracts import subjects
from contracts.control import Heartbeat
from contracts.detokenizer import FinishType, TokenBatch
from contracts.scheduler import ForkedChoice, GenerateRequest, LogprobParams, SamplingParams, SchedulerClaim, SchedulerClaimReply
from services.common.arrays import from_wire, to_wire
from services.common.connection import NatsConnection
from services.common.transport import Transport
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService, connect
from tests.nats_queues import queued

SCHEDULER_ID = "sched-faults"
PROMPT = np.arange(10, 30, dtype=np.int32)


@pytest.fixture
async def scheduler(nats_server, make_core):
    """(service, its run task, a client whose detok-1 subscription collects TokenBatches)."""
    config = SchedulerConfig(instance_id=SCHEDULER_ID, nats=NatsConnection(nats_url=nats_server.url, heartbeat_interval_s=0.2))
    client = await Transport.connect(nats_server.url, "test-client")
    batches = await queued(client, subjects.detokenizer_tokens("detok-1"), TokenBatch)
    beats = await queued(client, subjects.heartbeat("scheduler"), Heartbeat)
    await client.flush()
    stop = asyncio.Event()
    service = SchedulerService(config, make_core(max_model_len=64))
    task = asyncio.create_task(service.run(await connect(config), stop))
    await asyncio.wait_for(beats.get(), 10)
    yield service, task, client, batches
    stop.set()
    await asyncio.wait_for(task, 10)
    await client.close()


async def submit(client: Transport, rid: str, detokenizer_id: str, max_new_tokens: int = 4) -> None:
    reply = await client.request(subjects.SCHEDULER_CLAIM, SchedulerClaim(rid, len(PROMPT)), SchedulerClaimReply, 5)
    assert reply.accepted
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    request = GenerateRequest(rid=rid, input_ids=to_wire(PROMPT), detokenizer_id=detokenizer_id, sampling=sampling)
    await client.publish(subjects.scheduler_generate(SCHEDULER_ID), request)


async def finished_tokens(batches: asyncio.Queue[TokenBatch], rid: str) -> tuple[int, FinishType]:
    count = 0
    while True:
        batch = await asyncio.wait_for(batches.get(), 10)
        for index, batch_rid in enumerate(batch.rids):
            if batch_rid == rid:
                count += int(from_wire(batch.num_new_tokens)[index])
                if batch.finish[index] is not None:
                    return count, batch.finish[index].type


@pytest.mark.timeout(60)
async def test_a_detokenizer_id_with_a_space_is_dropped_and_the_scheduler_serves_on(scheduler):
    _service, task, client, batches = scheduler
    hostile = msgspec.msgpack.encode({"rid": "evil", "input_ids": to_wire(PROMPT), "detokenizer_id": "detok 1"})
    await client.publish(subjects.scheduler_generate(SCHEDULER_ID), hostile)
    await submit(client, "good", "detok-1")
    assert await finished_tokens(batches, "good") == (4, FinishType.LENGTH)
    assert not task.done()


@pytest.mark.timeout(60)
async def test_a_failing_destination_fails_only_its_own_requests(scheduler):
    service, task, client, batches = scheduler
    transport = service._transport
    publish = transport.publish
    broken = subjects.detokenizer_tokens("detok-broken")
    attempts: list[list[str]] = []

    async def failing_for_one_subject(subject, message):
        if subject == broken:
            attempts.append(list(message.rids))
            raise ConnectionError("this destination is gone")
        await publish(subject, message)

    transport.publish = failing_for_one_subject
    await submit(client, "lost", "detok-broken", max_new_tokens=40)
    await submit(client, "kept", "detok-1")
    assert await finished_tokens(batches, "kept") == (4, FinishType.LENGTH)
    assert not task.done()
    assert attempts and attempts[0] == ["lost"]
    await asyncio.sleep(0.3)
    assert len(attempts) < 40 and not service._core.has_work()  # aborted, not run to its 40 tokens


OUT_OF_MODEL = [  # well-formed on the wire, impossible for this model (vocab 2048, max_model_len 64)
    {"input_ids": to_wire(np.array([5, 99999], dtype=np.int32))},
    {"input_ids": to_wire(np.arange(100, dtype=np.int32))},
    {"logprobs": LogprobParams(return_logprob=True, top_logprobs_num=3000)},
    {"logprobs": LogprobParams(return_logprob=True, token_ids_logprob=(5, 4096))},
    {"logprobs": LogprobParams(return_logprob=True, logprob_start_len=50)},
    {"sampling": SamplingParams(stop_token_ids=(70000,))},
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fields", OUT_OF_MODEL, ids=lambda f: ",".join(f))
async def test_a_request_this_model_cannot_serve_fails_alone(scheduler, fields):
    _service, task, client, batches = scheduler
    await client.request(subjects.SCHEDULER_CLAIM, SchedulerClaim("odd", len(PROMPT)), SchedulerClaimReply, 5)
    request = GenerateRequest(**({"rid": "odd", "input_ids": to_wire(PROMPT), "detokenizer_id": "detok-1"} | fields))
    await client.publish(subjects.scheduler_generate(SCHEDULER_ID), request)
    count, finish = await finished_tokens(batches, "odd")
    assert (count, finish) == (0, FinishType.ABORT)
    await submit(client, "good", "detok-1")
    assert await finished_tokens(batches, "good") == (4, FinishType.LENGTH)
    assert not task.done()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_choices", [1, 3])
async def test_a_claim_whose_request_is_lost_in_transit_fails_at_its_detokenizer(nats_server, make_core, num_choices):
    config = SchedulerConfig(instance_id=SCHEDULER_ID, claim_expiry_s=0.4,
                             nats=NatsConnection(nats_url=nats_server.url, heartbeat_interval_s=0.2))  # fmt: skip
    client = await Transport.connect(nats_server.url, "test-client")
    batches = await queued(client, subjects.detokenizer_tokens("detok-1"), TokenBatch)
    await client.flush()
    stop = asyncio.Event()
    task = asyncio.create_task(SchedulerService(config, make_core(max_model_len=64)).run(await connect(config), stop))
    try:
        choices = tuple(ForkedChoice(f"never-sent.{j}", "detok-1") for j in range(1, num_choices))
        claim = SchedulerClaim("never-sent", len(PROMPT), detokenizer_id="detok-1", choices=choices)
        async with asyncio.timeout(10):
            while True:  # until the scheduler is subscribed and answers
                with contextlib.suppress(Exception):
                    assert (await client.request(subjects.SCHEDULER_CLAIM, claim, SchedulerClaimReply, 1)).accepted
                    break
                await asyncio.sleep(0.1)
        failed = {}
        while len(failed) < num_choices:  # its GenerateRequest is never published: every choice fails
            batch = await asyncio.wait_for(batches.get(), 10)
            failed |= {rid: finish for rid, finish in zip(batch.rids, batch.finish, strict=True)}
        assert set(failed) == {"never-sent", *(c.rid for c in choices)}
        assert all(f.type == FinishType.ABORT and "lost in transit" in f.message for f in failed.values())
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await client.close()
