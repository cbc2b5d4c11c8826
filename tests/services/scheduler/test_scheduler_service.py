"""The scheduler service alone over a real nats-server: claim -> generate -> TokenBatches."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time

import msgspec
import numpy as np
import pytest

from contracts import subjects
from contracts.control import Heartbeat
from contracts.detokenizer import FinishType, TokenBatch
from contracts.scheduler import (
    AbortRequest,
    ForkedChoice,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
    SchedulerClaim,
    SchedulerClaimReply,
    SchedulerInfo,
    SchedulerPing,
)
from services.common.arrays import from_wire, to_wire
from services.common.connection import NatsConnection
from services.common.transport import Transport
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService, connect

PROMPT = np.arange(10, 30, dtype=np.int32)


class Harness:
    """A running SchedulerService plus a client connection that plays tokenizer and detokenizer."""

    def __init__(self, service: SchedulerService, task: asyncio.Task[int], stop: asyncio.Event, client: Transport):
        self.service, self.task, self.stop, self.client = service, task, stop, client
        self.batches: asyncio.Queue[TokenBatch] = asyncio.Queue()
        self.beats: asyncio.Queue[Heartbeat] = asyncio.Queue()


@pytest.fixture
async def harness(nats_server, make_core):
    config = SchedulerConfig(instance_id="sched-test", nats=NatsConnection(nats_url=nats_server.url, heartbeat_interval_s=0.2))
    client = await Transport.connect(nats_server.url, "test-client")
    stop = asyncio.Event()
    service = SchedulerService(config, make_core(max_model_len=64))
    h = Harness(service, None, stop, client)

    async def on_batch(batch: TokenBatch, _msg) -> None:
        h.batches.put_nowait(batch)

    async def on_beat(beat: Heartbeat, _msg) -> None:
        h.beats.put_nowait(beat)

    await client.subscribe(subjects.detokenizer_tokens("detok-1"), TokenBatch, on_batch)
    await client.subscribe(subjects.heartbeat("scheduler"), Heartbeat, on_beat)
    await client.flush()
    h.task = asyncio.create_task(service.run(await connect(config), stop))
    beat = await asyncio.wait_for(h.beats.get(), 10)  # the first beat means subscriptions are live
    assert beat.alive and beat.instance_id == "sched-test"
    yield h
    stop.set()
    await asyncio.wait_for(h.task, 10)
    await client.close()


async def _claim(h: Harness, rid: str, num_prompt_tokens: int) -> SchedulerClaimReply:
    return await h.client.request(
        subjects.SCHEDULER_CLAIM, SchedulerClaim(rid, num_prompt_tokens), SchedulerClaimReply, timeout=5
    )


async def _collect(h: Harness, rid: str) -> tuple[list[int], list[TokenBatch]]:
    tokens, seen = [], []
    while True:
        batch = await asyncio.wait_for(h.batches.get(), 10)
        seen.append(batch)
        offsets = np.concatenate([[0], np.cumsum(from_wire(batch.num_new_tokens))])
        ids = from_wire(batch.new_token_ids)
        for index, batch_rid in enumerate(batch.rids):
            if batch_rid == rid:
                tokens.extend(ids[offsets[index] : offsets[index + 1]].tolist())
                if batch.finish[index] is not None:
                    return tokens, seen


@pytest.mark.timeout(60)
async def test_claim_generate_receive_until_finish(harness):
    h = harness
    reply = await _claim(h, "r1", len(PROMPT))
    assert reply == SchedulerClaimReply("sched-test", accepted=True, forks=True)
    request = GenerateRequest(
        rid="r1",
        input_ids=to_wire(PROMPT),
        detokenizer_id="detok-1",
        sampling=SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True),
        logprobs=LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=2),
    )
    await h.client.publish(subjects.scheduler_generate("sched-test"), request)
    tokens, batches = await _collect(h, "r1")
    assert len(tokens) == 5
    assert all(b.scheduler_id == "sched-test" for b in batches)
    assert batches[-1].finish[-1].type == FinishType.LENGTH
    from services.common.logprob_rows import from_columns

    output_logprobs = [rows.token for b in batches for rows in from_columns(b.output_logprobs, len(b.rids)) if rows is not None]
    assert sum(len(x) for x in output_logprobs) == 5
    prompt_logprobs = [rows.token for b in batches for rows in from_columns(b.prompt_logprobs, len(b.rids)) if rows is not None]
    assert sum(len(x) for x in prompt_logprobs) == len(PROMPT)


@pytest.mark.timeout(60)
async def test_the_next_step_runs_while_the_last_steps_outputs_are_published(harness):
    """The decode loop starts step N + 1 before it publishes step N's outputs, and the tokens still
    arrive complete and in order."""
    h, loop = harness, asyncio.get_running_loop()
    core, service = h.service._core, h.service
    step_of: dict[int, int] = {}  # id(outputs) -> the step call that made them
    calls = [0]
    stepped = asyncio.Event()

    def slow_step(on_queued=None):
        calls[0] += 1
        index = calls[0]
        loop.call_soon_threadsafe(stepped.set)
        time.sleep(0.02)  # the device at work
        outputs = original_step(on_queued)
        step_of[id(outputs)] = index
        return outputs

    async def watched_publish(outputs, step, *version):
        index = step_of.get(id(outputs))
        if index is not None:
            deadline = loop.time() + 1.0
            while calls[0] <= index and loop.time() < deadline:  # has a later step begun?
                stepped.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stepped.wait(), deadline - loop.time())
            overlapped.append(calls[0] > index)
        await original_publish(outputs, step, *version)

    original_step, original_publish, overlapped = core.step, service._publish, []
    core.step, service._publish = slow_step, watched_publish
    assert (await _claim(h, "r1", len(PROMPT))).accepted
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    await h.client.publish(subjects.scheduler_generate("sched-test"), GenerateRequest("r1", to_wire(PROMPT), "detok-1", sampling))
    tokens, _ = await _collect(h, "r1")
    assert len(tokens) == 6
    # every step's publication but the last ran beside the next step
    assert len(overlapped) >= 6 and all(overlapped[:-1]) and not overlapped[-1], overlapped


@pytest.mark.timeout(60)
async def test_forked_choices_one_claim_one_request_each_choice_finishes_and_one_aborted_early(harness):
    h = harness
    choices = tuple(ForkedChoice(f"f{j}", "detok-1", seed=j) for j in (1, 2, 3))
    claim = SchedulerClaim("f0", len(PROMPT), detokenizer_id="detok-1", choices=choices)
    reply = await h.client.request(subjects.SCHEDULER_CLAIM, claim, SchedulerClaimReply, timeout=5)
    assert reply.accepted and reply.forks
    await h.client.publish(subjects.SCHEDULER_ABORT, AbortRequest("f2"))  # before the request arrives
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0, ignore_eos=True)
    request = GenerateRequest("f0", to_wire(PROMPT), "detok-1", sampling, choices=choices)
    await h.client.publish(subjects.scheduler_generate("sched-test"), request)
    tokens, finishes = {}, {}
    while len(finishes) < 4:
        batch = await asyncio.wait_for(h.batches.get(), 10)
        offsets = np.concatenate([[0], np.cumsum(from_wire(batch.num_new_tokens))])
        for index, rid in enumerate(batch.rids):
            tokens.setdefault(rid, []).extend(from_wire(batch.new_token_ids)[offsets[index] : offsets[index + 1]].tolist())
            if batch.finish[index] is not None:
                finishes[rid] = batch.finish[index].type
    assert finishes == {"f0": FinishType.LENGTH, "f1": FinishType.LENGTH, "f2": FinishType.ABORT, "f3": FinishType.LENGTH}
    assert tokens["f2"] == [] and all(len(tokens[r]) == 4 for r in ("f0", "f1", "f3"))
    assert len({tuple(tokens[r]) for r in ("f0", "f1", "f3")}) == 3  # distinct seeds, distinct samples


@pytest.mark.timeout(60)
async def test_claim_rejects_too_long_prompt_and_ping_answers(harness):
    reply = await _claim(harness, "long", 65)
    assert not reply.accepted and "max_model_len" in reply.error
    info = await harness.client.request(subjects.SCHEDULER_PING, SchedulerPing(0.0), SchedulerInfo, timeout=5)
    assert info.scheduler_id == "sched-test" and info.max_model_len == 64 and info.vocab_size == 2048


@pytest.mark.timeout(60)
async def test_abort_finishes_running_request_and_shutdown_sends_dead_sentinel(harness):
    h = harness
    core_step = h.service._core.step

    def paced_step(on_queued=None):  # 40 steps take 0.8 s: the abort lands long before the last (the tiny model alone is faster)
        time.sleep(0.02)
        return core_step(on_queued)

    h.service._core.step = paced_step
    await _claim(h, "r2", len(PROMPT))
    request = GenerateRequest(
        rid="r2", input_ids=to_wire(PROMPT), detokenizer_id="detok-1",
        sampling=SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True),
    )
    await h.client.publish(subjects.scheduler_generate("sched-test"), request)
    await asyncio.wait_for(h.batches.get(), 10)  # it is running
    await h.client.publish(subjects.SCHEDULER_ABORT, AbortRequest("r2", reason="client gone"))
    tokens, batches = await _collect(h, "r2")
    assert len(tokens) < 40
    assert batches[-1].finish[-1].type == FinishType.ABORT
    h.stop.set()
    assert await asyncio.wait_for(h.task, 10) == 0
    while (beat := await asyncio.wait_for(h.beats.get(), 5)).alive:
        pass
    assert beat.reason == "the scheduler is shutting down"
    assert beat.drained  # everything it held was finished and published before the sentinel


@pytest.mark.timeout(60)
async def test_fatal_step_error_aborts_requests_sends_dead_sentinel_and_exits_nonzero(harness):
    h = harness

    def broken_step(on_queued=None):
        raise RuntimeError("device lost")

    h.service._core.step = broken_step  # the next step fails
    await _claim(h, "r3", len(PROMPT))
    request = GenerateRequest(rid="r3", input_ids=to_wire(PROMPT), detokenizer_id="detok-1")
    await h.client.publish(subjects.scheduler_generate("sched-test"), request)
    tokens, batches = await _collect(h, "r3")
    finish = batches[-1].finish[-1]
    assert tokens == [] and finish.type == FinishType.ABORT and "device lost" in finish.message
    assert await asyncio.wait_for(h.task, 10) == 1
    while (beat := await asyncio.wait_for(h.beats.get(), 5)).alive:
        pass
    assert "device lost" in beat.reason
    assert beat.drained  # the failure reached the request's detokenizer before the sentinel


@pytest.mark.timeout(60)
async def test_a_claim_whose_request_never_came_is_failed_at_its_detokenizer_on_shutdown(harness):
    h = harness
    connection = msgspec.structs.replace(h.service._config.nats, drain_timeout_s=0.2)
    h.service._config = dataclasses.replace(h.service._config, nats=connection)
    claim = SchedulerClaim("r4", len(PROMPT), detokenizer_id="detok-1")
    assert (await h.client.request(subjects.SCHEDULER_CLAIM, claim, SchedulerClaimReply, timeout=5)).accepted
    h.stop.set()  # the drain waits 0.2 s for r4's GenerateRequest, which never comes
    tokens, batches = await _collect(h, "r4")
    assert tokens == [] and batches[-1].finish[-1].type == FinishType.ABORT
    assert await asyncio.wait_for(h.task, 10) == 0
    while (beat := await asyncio.wait_for(h.beats.get(), 5)).alive:
        pass
    assert beat.drained


class Journal:
    """Records, in order, the steps a core finished, the steps the service published and its
    fail_all calls, and whether a step was running at each fail_all."""

    def __init__(self, service: SchedulerService) -> None:
        self.events: list[tuple[str, int]] = []
        self.stepping = False
        core = service._core
        step, publish, fail_all = core.step, service._publish, core.fail_all

        def journaled_step(on_queued=None):
            self.stepping = True
            try:
                self.before_step()
                outputs = step(on_queued)
            finally:
                self.stepping = False
            self.events.append(("stepped", core.num_steps))
            return outputs

        async def journaled_publish(outputs, number, *version):
            self.events.append(("published", number))
            return await publish(outputs, number, *version)

        def journaled_fail_all(message):
            self.events.append(("fail_all", 1 if self.stepping else 0))
            return fail_all(message)

        self.before_step = lambda: None
        core.step, service._publish, core.fail_all = journaled_step, journaled_publish, journaled_fail_all

    def stepped(self) -> list[int]:
        return [n for kind, n in self.events if kind == "stepped"]

    def published_before_fail_all(self) -> list[int]:
        end = self.events.index(("fail_all", 0))  # raises if fail_all ran during a step
        return [n for kind, n in self.events[:end] if kind == "published"]


@pytest.mark.timeout(60)
async def test_shutdown_during_a_step_publishes_its_outputs_before_fail_all(harness):
    """SIGTERM while a step runs (and the drain gives up at once): the step finishes, its batch
    goes out, and only then does fail_all finish what is left."""
    h, loop = harness, asyncio.get_running_loop()
    connection = msgspec.structs.replace(h.service._config.nats, drain_timeout_s=0.0)
    h.service._config = dataclasses.replace(h.service._config, nats=connection)
    journal = Journal(h.service)
    entered, release = asyncio.Event(), threading.Event()

    def hold_the_fourth_step():
        if len(journal.stepped()) == 3:
            loop.call_soon_threadsafe(entered.set)
            release.wait(10)

    journal.before_step = hold_the_fourth_step
    assert (await _claim(h, "r5", len(PROMPT))).accepted
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    await h.client.publish(subjects.scheduler_generate("sched-test"), GenerateRequest("r5", to_wire(PROMPT), "detok-1", sampling))
    await asyncio.wait_for(entered.wait(), 10)
    h.stop.set()
    while not h.service._closing:  # the shutdown has told the step thread to end after this step
        await asyncio.sleep(0.01)
    release.set()
    tokens, batches = await _collect(h, "r5")
    assert await asyncio.wait_for(h.task, 10) == 0
    assert len(tokens) == len(journal.stepped()) == 4  # one token per step, the held one's included
    assert batches[-1].finish[-1].type == FinishType.ABORT and batches[-1].finish[-1].message == "the scheduler is shutting down"
    assert journal.published_before_fail_all() == journal.stepped() == [1, 2, 3, 4]


@pytest.mark.timeout(60)
async def test_a_step_failing_after_good_steps_publishes_them_then_fails_the_request(harness):
    h = harness
    journal = Journal(h.service)

    def fail_the_fourth_step():
        if len(journal.stepped()) == 3:
            raise RuntimeError("device lost")

    journal.before_step = fail_the_fourth_step
    assert (await _claim(h, "r6", len(PROMPT))).accepted
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    await h.client.publish(subjects.scheduler_generate("sched-test"), GenerateRequest("r6", to_wire(PROMPT), "detok-1", sampling))
    tokens, batches = await _collect(h, "r6")
    assert await asyncio.wait_for(h.task, 10) == 1
    finish = batches[-1].finish[-1]
    assert len(tokens) == 3 and finish.type == FinishType.ABORT and finish.message.startswith("scheduler step failed: ")
    assert "device lost" in finish.message
    assert journal.published_before_fail_all() == [1, 2, 3]
    while (beat := await asyncio.wait_for(h.beats.get(), 5)).alive:
        pass
    assert "device lost" in beat.reason and beat.drained
