"""Overlapped steps (`SchedulerCore(overlap_decode=True)`, `Policy.expect` + `schedule(ahead=True)`):
the next step is planned from the host's state and launched before this one's tokens are read back
(they stay on the device, in the worker's token pool); likewise a prompt's next chunk. Outputs,
finishes and every logprob must be those of the same core without overlap, whatever finishes,
arrives or aborts meanwhile; the KV blocks of steps launched ahead must come back; and the overlap
must actually happen in steady decoding and in a long prefill."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from contracts.detokenizer import FinishType
from contracts.scheduler import LogprobParams
from services.scheduler.policy import StepPlan
from test_scheduler_core import prompt_of, request, run

LOGPROBS = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=5, token_ids_logprob=(7, 3, 1999))


def _workload(stop_at: int | None = None):
    """Greedy and seeded-sampled requests of several lengths, some with logprobs, one with a stop id."""
    out = [
        request("greedy", prompt_of(1, 9), max_new_tokens=7, ignore_eos=True, logprobs=LOGPROBS),
        request("sampled", prompt_of(2, 14), max_new_tokens=11, temperature=0.8, seed=5, ignore_eos=True, logprobs=LOGPROBS),
        request("short", prompt_of(3, 5), max_new_tokens=1, ignore_eos=True),
        request("topk", prompt_of(4, 20), max_new_tokens=9, temperature=1.0, seed=9, top_k=20, ignore_eos=True),
    ]
    if stop_at is not None:
        out.append(request("stops", prompt_of(6, 10), max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,)))
    return out


def _same(a: dict, b: dict) -> None:
    """Tokens, finishes and every logprob alike (entries compared joined: a different schedule may
    split a prompt's entries over other messages)."""
    assert set(a) == set(b)
    for rid in a:
        assert a[rid].tokens == b[rid].tokens, rid
        assert a[rid].finish == b[rid].finish, rid
        for name in ("input_token", "input_top_values", "input_top_ids", "input_ids",
                     "output_token", "output_top_values", "output_top_ids", "output_ids"):  # fmt: skip
            got, want = (np.concatenate(getattr(r[rid], name)) if getattr(r[rid], name) else np.zeros(0) for r in (a, b))
            # ids exact; values to float noise (a followed step's batch holds rows of finished requests)
            atol = 0 if name.endswith("top_ids") else 1e-5
            np.testing.assert_allclose(got, want, rtol=0, atol=atol, equal_nan=True, err_msg=f"{rid} {name}")


def _stop_token(make_core) -> int:
    alone = run(make_core(overlap_decode=False), [request("stops", prompt_of(6, 10), max_new_tokens=12, ignore_eos=True)])
    return alone["stops"].tokens[3]  # a stop four tokens in: finishes while its next step is in flight


@pytest.mark.parametrize("chunk", [256, 8])  # whole prompts in one step; prompts in chunks beside decodes
def test_outputs_equal_the_core_without_overlap(make_core, chunk) -> None:
    stop_at = _stop_token(make_core)
    joins = {3: [request("late", prompt_of(7, 6), max_new_tokens=5, ignore_eos=True, logprobs=LOGPROBS)]}
    plain = run(make_core(overlap_decode=False, chunked_prefill_size=chunk), _workload(stop_at), joins=dict(joins))
    overlapped = run(make_core(overlap_decode=True, chunked_prefill_size=chunk), _workload(stop_at), joins=dict(joins))
    assert overlapped["stops"].finish.type == FinishType.STOP and len(overlapped["stops"].tokens) < 12
    _same(overlapped, plain)


def test_an_abort_while_the_next_step_is_in_flight(make_core) -> None:
    core = make_core(overlap_decode=True)
    results = run(core, _workload(), abort_at={4: ["sampled"]})
    assert results["sampled"].finish.type == FinishType.ABORT and 0 < len(results["sampled"].tokens) < 11
    plain = run(make_core(overlap_decode=False), _workload())
    for rid in ("greedy", "short", "topk"):
        assert results[rid].tokens == plain[rid].tokens


def test_followed_steps_give_their_kv_blocks_back(make_core) -> None:
    core = make_core(overlap_decode=True)
    free_at_start = core.stats().num_free_blocks
    run(core, _workload(_stop_token(make_core)))
    assert not core.has_work()
    assert core.stats().num_free_blocks == free_at_start


def _spy_launches(core, events: list) -> None:
    """Record ("launch", ahead) per launch (ahead: another launched step is not collected yet) and
    ("collect",) per collect."""
    launch, collect = core.worker.launch, core.worker.collect
    outstanding = []

    def launching(plan):
        events.append(("launch", bool(outstanding)))
        outstanding.append(plan)
        return launch(plan)

    def collecting(launched):
        events.append(("collect",))
        outstanding.remove(launched.plan)
        return collect(launched)

    core.worker.launch, core.worker.collect = launching, collecting


def test_steady_decoding_launches_each_step_before_reading_the_last(make_core) -> None:
    core = make_core(overlap_decode=True)
    events = []
    _spy_launches(core, events)
    run(core, [request("a", prompt_of(8, 12), max_new_tokens=6, ignore_eos=True)])
    # prefill, then the first decode queued behind it, then each decode queued before the last is read;
    # the step that samples the 6th token is not followed (nothing left to sample)
    assert events[:4] == [("launch", False), ("launch", True), ("collect",), ("launch", True)]
    assert events.count(("launch", True)) == 5 and events.count(("collect",)) == 6
    assert len(run(core, [request("b", prompt_of(8, 12), max_new_tokens=6, ignore_eos=True)])["b"].tokens) == 6


def test_each_step_says_its_device_work_is_queued_before_it_waits(make_core) -> None:
    """`step(on_queued)` calls it once a step, after the launches the step makes (the next step's
    too, where it follows) and before it collects; `has_in_flight` then says whether a step follows
    (what `StepThread` hands the step before's outputs over on)."""
    core = make_core(overlap_decode=True)
    events = []
    _spy_launches(core, events)
    core.add(request("a", prompt_of(9, 12), max_new_tokens=4, ignore_eos=True))
    while core.has_work():
        core.step(lambda: events.append(("queued", core.has_in_flight)))
        events.append(("returned", core.has_in_flight))
    followed = [("launch", True), ("queued", True), ("collect",), ("returned", True)]
    # the prefill with the first decode queued behind it; two more decodes each queued before the
    # last is read; the step that samples the 4th token follows nothing
    assert events == [("launch", False), *followed, *followed, *followed, ("queued", False), ("collect",), ("returned", False)]
    assert core.step(lambda: events.append(("queued", None))) == [] and events[-1] == ("queued", None)  # nothing to run


def _first_decodes_in_flight(make_core):
    """A core that has run the workload's prompts, with their first decodes launched behind them."""
    core = make_core(overlap_decode=True)
    for r in _workload():
        core.add(r)
    core.step()
    return core, core._in_flight


def test_what_is_never_followed(make_core) -> None:
    core, launched = _first_decodes_in_flight(make_core)
    assert launched is not None and all(s.from_pool and not s.tokens for s in launched.plan.steps)
    assert "short" not in {s.rid for s in launched.plan.steps}  # max_new_tokens=1: nothing left to sample
    assert core.policy.can_expect(launched.plan)
    first = launched.plan.steps[0]
    penalised = msgspec.structs.replace(first.params.sampling, repetition_penalty=1.3)
    params = msgspec.structs.replace(first.params, sampling=penalised, processes_logits=True, has_penalties=True)
    plan = StepPlan([msgspec.structs.replace(first, params=params), *launched.plan.steps[1:]])
    assert not core.policy.can_expect(plan)  # penalties read the token history on the host


def test_an_arrival_joins_the_followed_step_beside_the_decodes(make_core) -> None:
    core, launched = _first_decodes_in_flight(make_core)
    decoding = [s.rid for s in launched.plan.steps]
    core.policy.add(request("waiting", prompt_of(9, 4)))
    core.policy.expect(launched.plan)
    following = core.policy.schedule(ahead=True)
    assert [s.rid for s in following.steps] == [*decoding, "waiting"]
    assert all(s.from_pool and not s.tokens for s in following.steps[:-1])
    arrival = following.steps[-1]
    assert arrival.start == 0 and not arrival.from_pool and arrival.tokens == list(prompt_of(9, 4)) and arrival.samples


def test_arrivals_beside_followed_decodes_are_launched_before_the_last_readback(make_core) -> None:
    core = make_core(overlap_decode=True)
    events, launches = [], []
    _spy_launches(core, events)
    launch = core.worker.launch

    def record(plan):
        launched = launch(plan)
        launches.append((events[-1][1], [(s.rid, s.from_pool) for s in plan.steps]))
        return launched

    core.worker.launch = record
    first = [request(f"d{i}", prompt_of(60 + i, 6), max_new_tokens=8, ignore_eos=True, logprobs=LOGPROBS) for i in range(3)]
    late = [request("late", prompt_of(70, 7), max_new_tokens=4, ignore_eos=True, logprobs=LOGPROBS)]
    overlapped = run(core, first, joins={3: list(late)})
    plain = run(make_core(overlap_decode=False), first, joins={3: list(late)})
    _same(overlapped, plain)
    mixed = [steps for ahead, steps in launches if ahead and any(not from_pool for _, from_pool in steps)]
    assert mixed and mixed[0][-1] == ("late", False), launches  # its prompt chunk rode a step launched ahead


def _launched_plans(core) -> list:
    """Every step the core launches, as what the device is asked to compute (a decode's token aside:
    a followed decode's is on the device only)."""
    plans, launch = [], core.worker.launch

    def record(plan):
        # (KV slots aside: a step launched ahead plans before the last step's finishes free their blocks)
        plans.append([(s.rid, s.start, tuple(s.tokens) if s.start < s.params.num_prompt else "decode", s.samples,
                       s.prompt_lo, s.prompt_hi, len(s.slots)) for s in plan.steps])  # fmt: skip
        return launch(plan)

    core.worker.launch = record
    return plans


LONG_PROMPTS = [  # chunked: logprobs from the start, from mid-prompt, flat rows, none, a prompt only scored
    request("all", prompt_of(50, 45), max_new_tokens=3, ignore_eos=True, logprobs=LOGPROBS),
    request("mid", prompt_of(51, 30), max_new_tokens=2, ignore_eos=True,
            logprobs=LogprobParams(return_logprob=True, logprob_start_len=17, top_logprobs_num=2)),
    request("flat", prompt_of(52, 26), max_new_tokens=2, ignore_eos=True,
            logprobs=LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=3, flat_prompt_top_logprobs=True)),
    request("plain", prompt_of(53, 33), max_new_tokens=2, ignore_eos=True),
    request("scored", prompt_of(54, 21), max_new_tokens=0, logprobs=LOGPROBS),
]  # fmt: skip


@pytest.mark.parametrize("chunk", [8, 16])
def test_a_long_prompts_chunks_are_launched_back_to_back_as_scheduled(make_core, chunk) -> None:
    for r in LONG_PROMPTS:
        plain_core, overlapped_core = make_core(overlap_decode=False, chunked_prefill_size=chunk), make_core(chunked_prefill_size=chunk)
        plain_plans, overlapped_plans = _launched_plans(plain_core), _launched_plans(overlapped_core)
        events = []
        collect = overlapped_core.worker.collect
        overlapped_core.worker.collect = lambda launched: events.append(len(overlapped_plans)) or collect(launched)
        plain, overlapped = run(plain_core, [r]), run(overlapped_core, [r])
        _same(overlapped, plain)
        if r.rid == "flat":
            assert overlapped["flat"].flat is not None
            np.testing.assert_array_equal(overlapped["flat"].flat[0], plain["flat"].flat[0])
        assert overlapped_plans == plain_plans, r.rid  # the followed chunks are the ones `schedule` plans
        num_chunks = -(-len(r.prompt_ids) // chunk)
        # the first chunk and the second are launched before the first is read back, and so on
        assert events[: num_chunks - 1] == list(range(2, num_chunks + 1)), (r.rid, events)


def test_prompts_side_by_side_and_a_budget_they_share(make_core) -> None:
    """Several prompts in one step, the budget split as `schedule` splits it, each followed."""
    requests = [request(f"p{i}", prompt_of(60 + i, 13 + 7 * i), max_new_tokens=2, ignore_eos=True, logprobs=LOGPROBS) for i in range(3)]
    cores = make_core(overlap_decode=False, chunked_prefill_size=16), make_core(chunked_prefill_size=16)
    plans = [_launched_plans(core) for core in cores]
    plain, overlapped = (run(core, requests) for core in cores)
    _same(overlapped, plain)
    assert plans[1] == plans[0]
    assert any(len(plan) > 1 for plan in plans[1])


def test_what_a_prompt_chunk_is_followed_by(make_core) -> None:
    """A chunk that samples nothing is followed by the prompt's next chunk, planned as `schedule`
    plans it (an arrival waits where the chunk takes the budget); chunks beside a decode are
    followed too (the decode's token is in the pool), with the outputs of the core without overlap."""
    core = make_core(chunked_prefill_size=8)
    core.add(request("long", prompt_of(70, 40), max_new_tokens=4, ignore_eos=True))
    core.step()
    launched = core._in_flight
    assert launched is not None and launched.plan.steps[0].start == 8 and not launched.plan.steps[0].samples
    policy = core.policy
    policy.add(request("waiting", prompt_of(71, 4)))
    policy.expect(launched.plan)
    following = policy.schedule(ahead=True)
    assert [(s.rid, s.start) for s in following.steps] == [("long", 16)] and policy.num_waiting == 1  # the budget is the chunk's
    requests = [request("d", prompt_of(72, 4), max_new_tokens=1, ignore_eos=True),
                request("d2", prompt_of(73, 5), max_new_tokens=20, ignore_eos=True)]  # fmt: skip
    joins = {4: [request("long", prompt_of(70, 40), max_new_tokens=4, ignore_eos=True)]}
    decoding = make_core(chunked_prefill_size=8)
    events = []
    _spy_launches(decoding, events)
    plans = _launched_plans(decoding)
    overlapped = run(decoding, requests, joins=dict(joins))
    _same(overlapped, run(make_core(chunked_prefill_size=8, overlap_decode=False), requests, joins=dict(joins)))
    launched_ahead = [ahead for event, ahead, *_ in (e + (None,) for e in events) if event == "launch"]
    mixed = [i for i, plan in enumerate(plans) if {rid for rid, *_ in plan} == {"d2", "long"}]
    assert mixed and all(launched_ahead[i] for i in mixed[1:])  # chunks beside a decode, launched ahead


@pytest.mark.parametrize("flag", [False, True])
def test_the_config_switch_reaches_the_core(flag) -> None:
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.build import build_core

    assert SchedulerConfig().overlap_decode is True
    assert build_core(SchedulerConfig(device="cpu", overlap_decode=flag)).overlap_decode is flag


def test_a_request_waiting_for_a_slot_does_not_stop_overlap(make_core) -> None:
    core = make_core(overlap_decode=True, max_running_requests=2)
    events = []
    _spy_launches(core, events)
    requests = [request(f"q{i}", prompt_of(30 + i, 8), max_new_tokens=10, ignore_eos=True) for i in range(4)]
    results = run(core, requests)
    assert all(len(results[r.rid].tokens) == 10 for r in requests)
    # two run while two wait for a slot: the decodes of the first pair are launched ahead all the same
    followed = [event[1] for event in events if event[0] == "launch"]
    assert sum(followed[:10]) >= 8, followed


# ---- randomized: forks, preemption, chunking, joins, stops, logprobs, sampling; on against off ----

FUZZ_LOGPROBS = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=(7, 3))


def _random_workload(rng, with_aborts: bool):
    from contracts.scheduler import ForkedChoice

    requests, joins, aborts = [], {}, {}
    for i in range(rng.randint(2, 7)):
        options = dict(max_new_tokens=rng.randint(1, 14), ignore_eos=rng.random() < 0.7)
        if rng.random() < 0.5:
            options.update(temperature=0.9, seed=rng.randint(0, 99))
        if rng.random() < 0.4:
            options["logprobs"] = FUZZ_LOGPROBS
        r = request(f"r{i}", prompt_of(rng.randint(0, 1000), rng.randint(1, 40)), **options)
        if rng.random() < 0.3:  # n > 1: forked choices
            r = dataclasses.replace(r, choices=tuple(ForkedChoice(f"r{i}.{j}", "detok", j + 11) for j in range(1, rng.randint(2, 4))))
        when = rng.choice([0, 0, 1, 3, 5, 8])
        (requests if when == 0 else joins.setdefault(when, [])).append(r)
        if with_aborts and rng.random() < 0.25:
            aborts.setdefault(rng.randint(1, 12), []).append(r.rid)
    options = {"chunked_prefill_size": rng.choice([4, 8, 256]), "max_running_requests": rng.choice([2, 4, 64])}
    blocks = rng.choice([None, 6, 10, 16])  # small: preemption
    return requests, joins, aborts, options | ({"num_blocks": blocks} if blocks else {})


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_equal_the_core_without_overlap(make_core, seed) -> None:
    import random

    requests, joins, _, options = _random_workload(random.Random(seed), with_aborts=False)
    plain_core, overlapped_core = make_core(overlap_decode=False, **options), make_core(overlap_decode=True, **options)
    free = plain_core.stats().num_free_blocks
    plain = run(plain_core, requests, joins=dict(joins))
    overlapped = run(overlapped_core, requests, joins=dict(joins))
    _same(overlapped, plain)
    assert overlapped_core.stats().num_free_blocks == free and not overlapped_core.has_work()
    assert overlapped_core.stats().num_preemptions == plain_core.stats().num_preemptions


@pytest.mark.parametrize("seed", range(8))
def test_random_aborts_leave_prefixes_and_free_blocks(make_core, seed) -> None:
    import random

    requests, joins, aborts, options = _random_workload(random.Random(100 + seed), with_aborts=True)
    full = run(make_core(overlap_decode=False, **options), requests, joins=dict(joins))
    core = make_core(overlap_decode=True, **options)
    free = core.stats().num_free_blocks
    results = run(core, requests, joins=dict(joins), abort_at=dict(aborts))
    aborted = {rid for rids in aborts.values() for rid in rids}
    for rid, result in results.items():
        if rid in aborted and result.finish is not None and result.finish.type == FinishType.ABORT:
            assert result.tokens == full[rid].tokens[: len(result.tokens)], rid
        else:
            assert result.tokens == full[rid].tokens, rid
    assert core.stats().num_free_blocks == free and not core.has_work()


def test_steady_greedy_decoding_uploads_only_pool_rows_and_reads_back_only_tokens(make_core, monkeypatch) -> None:
    """A decode step takes its queries from the token pool and puts its tokens back in the same rows
    (no input_ids, no pool_positions, no put_rows); its rows are its verify rows (no verify_rows);
    plain greedy decoding reads back its tokens alone (no accepted counts). Outputs as without overlap."""
    from services.scheduler.host_io import HostReadback, HostUpload

    sends, parts = [], []
    send, add = HostUpload.send, HostReadback.add
    monkeypatch.setattr(HostUpload, "send", lambda self, arrays: sends.append(set(arrays)) or send(self, arrays))
    monkeypatch.setattr(HostReadback, "add", lambda self, tensor: parts.append(tensor.shape) or add(self, tensor))
    requests = [request(f"g{i}", prompt_of(i, 6 + i), max_new_tokens=6, ignore_eos=True) for i in range(3)]
    overlapped = run(make_core(overlap_decode=True), requests)
    decodes = sends[1:]  # after the one prefill step
    assert len(decodes) >= 5 and all(not {"input_ids", "pool_positions", "put_rows", "verify_rows"} & names for names in decodes)
    assert parts[1:] and all(shape == (3, 1) for shape in parts[1:])  # [P, 1] tokens only, one part a step
    monkeypatch.undo()
    plain = run(make_core(overlap_decode=False), [request(f"g{i}", prompt_of(i, 6 + i), max_new_tokens=6, ignore_eos=True) for i in range(3)])
    assert {rid: r.tokens for rid, r in overlapped.items()} == {rid: r.tokens for rid, r in plain.items()}
