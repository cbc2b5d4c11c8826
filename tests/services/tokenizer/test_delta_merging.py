"""A request's deltas that queue up while its handler is busy come out merged into one (requests.py):
nothing lost, duplicated or reordered, a failure still raised after the deltas before it, and one
SSE event of the merged delta folds to the same response as one event per delta."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np

from contracts.detokenizer import DetokenizeParams, Finish, FinishType
from services.common.logprob_rows import RequestLogprobs
from tests.logprob_entries import logprobs_of
from contracts.scheduler import LogprobParams, SamplingParams
from services.common.arrays import to_wire
from services.recorder.golden import fold_stream
from services.tokenizer.json_body import encode_json
from services.tokenizer.native import GenerationResult, native_event
from services.tokenizer.requests import Delta, Failure, PendingRequest, RequestFailed, merge_deltas
from services.tokenizer.validation import GenerationSpec

K = 2


def step_logprobs(first: int, count: int) -> RequestLogprobs:
    """Output entries for `count` tokens from output position `first` (values distinct per position)."""
    positions = np.arange(first, first + count)
    return logprobs_of(
        output_token_logprobs=to_wire((-0.5 - positions).astype("<f4")),
        output_top_logprobs=to_wire(np.stack([-0.25 - positions, -1.5 - positions], axis=1).astype("<f4")),
        output_top_ids=to_wire(np.stack([positions + 3, positions + 9], axis=1).astype("<i4")),
    )


def step(first: int, tokens: list[int], text: str, finish: Finish | None = None, verify_ct: int | None = None) -> Delta:
    return Delta(text, tokens, 4, finish, (step_logprobs(first, len(tokens)),), verify_ct)


STEPS = [step(0, [11], "a"), step(1, [12, 13], "bc", verify_ct=2), step(3, [14], "d", Finish(FinishType.LENGTH), verify_ct=3)]


def spec(stream: bool = True) -> GenerationSpec:
    return GenerationSpec("r", (1, 2, 3, 4), SamplingParams(max_new_tokens=4), LogprobParams(return_logprob=True, top_logprobs_num=K),
                          DetokenizeParams(), stream=stream)  # fmt: skip


async def consumed(pending: PendingRequest) -> tuple[list[Delta], str | None]:
    got, failure = [], None
    try:
        async for delta in pending.deltas():
            got.append(delta)
    except RequestFailed as exc:
        failure = str(exc)
    return got, failure


def test_merge_joins_tokens_text_and_entries_in_order_and_keeps_the_running_totals():
    merged = merge_deltas(STEPS)
    assert (merged.text, merged.token_ids, merged.finish, merged.spec_verify_ct) == ("abcd", [11, 12, 13, 14], STEPS[-1].finish, 3)
    assert merged.logprobs == tuple(d.logprobs[0] for d in STEPS)
    assert merge_deltas(STEPS[:1]) is STEPS[0]
    no_counts = Delta("e", [15], 0, None, (), None)
    assert (merge_deltas([STEPS[1], no_counts]).prompt_tokens, merge_deltas([STEPS[1], no_counts]).spec_verify_ct) == (4, 2)


async def test_deltas_waiting_in_the_queue_come_out_as_one():
    pending = PendingRequest(spec())
    for delta in STEPS:
        pending.queue.put_nowait(delta)
    got, failure = await consumed(pending)
    assert failure is None and len(got) == 1 and got[0].token_ids == [11, 12, 13, 14]


async def test_a_reader_that_keeps_up_gets_one_delta_per_step():
    pending = PendingRequest(spec())

    async def produce() -> None:
        for delta in STEPS:
            pending.queue.put_nowait(delta)
            await asyncio.sleep(0.01)

    producer = asyncio.create_task(produce())
    got, failure = await consumed(pending)
    await producer
    assert failure is None and [d.token_ids for d in got] == [[11], [12, 13], [14]]


async def test_a_failure_behind_waiting_deltas_is_raised_after_them():
    pending = PendingRequest(spec())
    pending.queue.put_nowait(STEPS[0])
    pending.queue.put_nowait(STEPS[1])
    pending.queue.put_nowait(Failure("scheduler gone"))
    got, failure = await consumed(pending)
    assert [d.token_ids for d in got] == [[11, 12, 13]] and failure == "scheduler gone"


async def test_merging_stops_at_the_finish():
    pending = PendingRequest(spec())
    for delta in [*STEPS, step(4, [99], "z")]:  # nothing follows a finish on the wire; if it did, it is not read
        pending.queue.put_nowait(delta)
    got, _ = await consumed(pending)
    assert got[-1].token_ids[-1] == 14 and pending.queue.qsize() == 1


def events_of(deltas: list[Delta]) -> list[dict]:
    result = GenerationResult(spec())
    events = []
    for delta in deltas:
        result.add(delta)
        events.append(msgspec.json.decode(encode_json(native_event(result, delta, model=None))))
    return events


def test_one_event_of_merged_steps_folds_like_an_event_per_step():
    apart, merged = events_of(STEPS), events_of([merge_deltas(STEPS[:2]), STEPS[2]])
    assert len(apart) == 3 and len(merged) == 2
    for events in (apart, merged):
        for event in events:
            event["meta_info"]["e2e_latency"] = 0.0
    assert fold_stream(apart) == fold_stream(merged)
    meta = fold_stream(merged)[0]["meta_info"]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == [11, 12, 13, 14]
    assert [[e[1] for e in row] for row in meta["output_top_logprobs"]] == [[3, 9], [4, 10], [5, 11], [6, 12]]
    assert merged[0]["meta_info"]["completion_tokens"] == 3 and len(merged[0]["meta_info"]["output_token_logprobs"]) == 3
