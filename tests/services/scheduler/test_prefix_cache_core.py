"""Automatic prefix caching on the tiny CPU model: every result with the cache on equals the cache
off (tokens and every logprob kind), while the shared prefixes are computed once; blocks are
never handed out while held and all are free at the end."""

from __future__ import annotations

import dataclasses

import pytest

from contracts.detokenizer import FinishType
from contracts.scheduler import ForkedChoice, LogprobParams
from test_dspark_core import dspark  # noqa: F401 (fixture)
from test_scheduler_core import ALL_LOGPROBS, prompt_of, request, run
from test_speculative_loop import _assert_same

BASE = prompt_of(91, 80)
OUTPUT_ONLY = LogprobParams(return_logprob=True, logprob_start_len=-1, top_logprobs_num=5, token_ids_logprob=(7, 3, 1999))
LATE_PROMPT = LogprobParams(return_logprob=True, logprob_start_len=37, top_logprobs_num=3, token_ids_logprob=(11,))
FLAT_LATE = LogprobParams(return_logprob=True, logprob_start_len=35, top_logprobs_num=4, flat_prompt_top_logprobs=True)
KINDS = (None, OUTPUT_ONLY, LATE_PROMPT, ALL_LOGPROBS, FLAT_LATE)


def sharing(tag: str, lengths, **options) -> list:
    """Requests whose prompts are BASE's first `length` tokens and a tail of their own, of every logprob kind."""
    requests = []
    for i, length in enumerate(lengths):
        prompt = BASE[:length] + prompt_of(length, 3 + length % 5)
        kind = KINDS[i % len(KINDS)]
        kind = ALL_LOGPROBS if kind is not None and kind.logprob_start_len >= len(prompt) else kind
        requests.append(request(f"{tag}{length}", prompt, logprobs=kind, ignore_eos=True, max_new_tokens=6, **options))
    return requests


def both(make_core, requests, joins=None, abort_at=None, **settings):
    """(cache off, cache on): results and the cache-on core."""
    off = run(make_core(prefix_caching=False, **settings), requests, joins, abort_at)
    core = make_core(**settings)
    return off, run(core, requests, joins, abort_at), core


def assert_all_free(core) -> None:
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_blocks


ALIGNMENTS = [15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 79, 80]


@pytest.mark.parametrize("chunk", [24, 256])
def test_prompts_sharing_prefixes_at_every_alignment_equal_the_cache_off(make_core, chunk):
    first = request("seed", BASE + [5, 6], ignore_eos=True, max_new_tokens=4)
    joins = {3: sharing("a", ALIGNMENTS), 9: sharing("b", ALIGNMENTS[::-3], temperature=1.0, seed=7)}
    off, on, core = both(make_core, [first], joins, chunked_prefill_size=chunk)
    _assert_same(off, on)
    assert all(result.finish.type == FinishType.LENGTH for result in on.values())
    stats = core.stats()
    assert stats.num_prefix_hits >= 16 * len(ALIGNMENTS)  # at least one block each: the prefixes were not recomputed
    assert stats.num_prompt_tokens + stats.num_prefix_hits == sum(len(r.prompt_ids) for r in [first, *joins[3], *joins[9]])
    assert_all_free(core)


def test_a_repeated_prompt_computes_only_its_last_partial_block(make_core):
    prompt = BASE[:70]
    off, on, core = both(make_core, [request("x", prompt, max_new_tokens=3)], {4: [request("y", prompt, max_new_tokens=3)]})
    _assert_same(off, on)
    assert (core.stats().num_prefix_hits, core.stats().num_prompt_tokens) == (64, 70 + 6)
    off_core = make_core(prefix_caching=False)
    run(off_core, [request("x", prompt, max_new_tokens=3)], {4: [request("y", prompt, max_new_tokens=3)]})
    assert (off_core.stats().num_prefix_hits, off_core.stats().num_prompt_tokens) == (0, 140)


def test_prompt_logprob_rows_wanted_from_a_position_bound_the_hit(make_core):
    # rows from position 37 need position 36 computed: blocks [0, 32) may come from the cache, no more
    second = request("y", BASE[:70], logprobs=LATE_PROMPT, max_new_tokens=3)
    off, on, core = both(make_core, [request("x", BASE[:70], max_new_tokens=3)], {4: [second]})
    _assert_same(off, on)
    assert core.stats().num_prefix_hits == 32
    assert on["y"].input_start == 37


def test_eviction_pressure_and_preemption_equal_the_cache_off(make_core):
    # 6 blocks of 16 for 12 requests over 4 prefixes of 18..45 tokens: the cache is evicted over and over
    prompts = [BASE[: 18 + 9 * i] for i in range(4)]
    requests = [request(f"r{i}", prompts[i % 4] + [i % 7 + 3], max_new_tokens=30, ignore_eos=True,
                        logprobs=KINDS[i % 3]) for i in range(12)]  # fmt: skip
    off, on, core = both(make_core, requests, num_blocks=6, chunked_prefill_size=32)
    _assert_same(off, on)
    assert core.num_preemptions > 0 and core.stats().num_prefix_hits > 0
    assert_all_free(core)


def test_aborts_mid_prefill_equal_the_cache_off_and_free_every_block(make_core):
    requests = sharing("a", [33, 48, 64, 79])
    joins = {5: sharing("b", [33, 48, 64, 79])}
    abort_at = {2: ["a48", "a79"], 6: ["b64"]}  # chunks of 8: all three are still prefilling
    off, on, core = both(make_core, requests, joins, abort_at, chunked_prefill_size=8)
    for rid in ("a48", "a79", "b64"):
        assert on[rid].finish.type == FinishType.ABORT
    keep = [rid for rid in off if rid not in abort_at[2] + abort_at[6]]
    _assert_same({rid: off[rid] for rid in keep}, {rid: on[rid] for rid in keep})
    assert_all_free(core)


def test_forked_choices_over_a_cached_prefix_equal_the_cache_off(make_core):
    seeds = (3, 5, 8)
    first = request("seed", BASE[:64] + [9], max_new_tokens=2)
    forked = dataclasses.replace(
        request("f", BASE[:72], temperature=1.0, seed=seeds[0], logprobs=OUTPUT_ONLY, max_new_tokens=6, ignore_eos=True),
        choices=tuple(ForkedChoice(f"f.{j}", "detok", seed) for j, seed in enumerate(seeds[1:], start=1)),
    )  # fmt: skip
    off, on, core = both(make_core, [first], {4: [forked]})
    _assert_same(off, on)
    # the prompt's 4 cached blocks once, then each fork's shared 4 blocks
    assert core.stats().num_prefix_hits == 64 + 2 * 64
    assert_all_free(core)


@pytest.mark.parametrize("chunk", [16, 256])
def test_dspark_over_cached_prefixes_equals_the_cache_off(make_core, dspark, chunk):  # noqa: F811
    first = request("seed", BASE + [5], ignore_eos=True, max_new_tokens=5)
    joins = {4: sharing("a", [17, 32, 49, 80])}
    off_core = make_core(prefix_caching=False, chunked_prefill_size=chunk, proposer=dspark())
    off = run(off_core, [first], joins)
    core = make_core(chunked_prefill_size=chunk, proposer=dspark())
    on = run(core, [first], joins)
    _assert_same(off, on)
    # the drafter's keys and values of the cached positions were cached with the target's (same slots): the same drafts
    assert {rid: r.spec_verify_ct for rid, r in on.items()} == {rid: r.spec_verify_ct for rid, r in off.items()}
    assert core.stats().num_prefix_hits > 0 and core.stats().num_drafted_tokens > 0
    assert core.stats().num_accepted_tokens == off_core.stats().num_accepted_tokens
    assert_all_free(core)


def test_multi_turn_conversation_hits_its_own_history(make_core):
    """Turn t's prompt is turn t-1's prompt and answer plus a new message: all but the tail is cached."""
    prompt, results, core = BASE[:20], [], make_core()
    for turn in range(4):
        got = run(core, [request(f"t{turn}", prompt, max_new_tokens=8, ignore_eos=True)])[f"t{turn}"]
        results.append(got.tokens)
        prompt = prompt + got.tokens + prompt_of(turn, 5)
    assert core.stats().num_prefix_hits >= 16 + 32 + 48
    off_core, prompt = make_core(prefix_caching=False), BASE[:20]
    for turn in range(4):
        got = run(off_core, [request(f"t{turn}", prompt, max_new_tokens=8, ignore_eos=True)])[f"t{turn}"]
        assert got.tokens == results[turn]
        prompt = prompt + got.tokens + prompt_of(turn, 5)


def test_cached_tokens_ride_every_output_and_the_token_batch(make_core):
    from services.common.arrays import from_wire
    from services.scheduler.wire import to_token_batches

    core = make_core()
    run(core, [request("x", BASE[:70], max_new_tokens=2)])
    core.add(request("y", BASE[:70], max_new_tokens=2))
    outputs = []
    while core.has_work():
        outputs += core.step()
    assert outputs and all(o.cached_tokens == 64 for o in outputs)
    batch = to_token_batches(outputs, "s", 1)["detok"]
    assert from_wire(batch.cached_tokens).tolist() == [64] * len(outputs)
    fresh = make_core(prefix_caching=False)
    fresh.add(request("z", BASE[:70], max_new_tokens=2))
    assert all(o.cached_tokens == 0 for o in fresh.step())


TOP5 = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=5)
TOP8_LATE = LogprobParams(return_logprob=True, logprob_start_len=20, top_logprobs_num=8)


def test_kept_prompt_rows_are_returned_without_computing_the_prefix(make_core):
    prompt = BASE[:70]
    core = make_core()
    first = run(core, [request("x", prompt, logprobs=TOP5, max_new_tokens=2)])["x"]
    computed = core.stats().num_prompt_tokens
    second = run(core, [request("y", prompt, logprobs=TOP5, max_new_tokens=2)])["y"]
    assert core.stats().num_prompt_tokens - computed == 70 - 64  # the 4 cached blocks' rows were kept, not computed
    _assert_same({"r": first}, {"r": second})
    assert second.input_start == 0 and len(second.cat("input_token")) == 70
    # top-3 of the kept top-5, from a later position: still no prefill of the prefix
    computed = core.stats().num_prompt_tokens
    three = LogprobParams(return_logprob=True, logprob_start_len=5, top_logprobs_num=3)
    third = run(core, [request("z", prompt, logprobs=three, max_new_tokens=2)])["z"]
    assert core.stats().num_prompt_tokens - computed == 6
    cold = run(make_core(prefix_caching=False), [request("z", prompt, logprobs=three, max_new_tokens=2)])
    _assert_same(cold, {"z": third})


def test_a_larger_k_than_kept_recomputes_and_equals_a_cold_server(make_core):
    prompt = BASE[:70]
    core = make_core()
    run(core, [request("x", prompt, logprobs=TOP5, max_new_tokens=2)])
    computed = core.stats().num_prompt_tokens
    got = run(core, [request("y", prompt, logprobs=TOP8_LATE, max_new_tokens=3)])
    assert core.stats().num_prompt_tokens - computed == 70 - 16  # only the block before position 19 came from the cache
    _assert_same(run(make_core(prefix_caching=False), [request("y", prompt, logprobs=TOP8_LATE, max_new_tokens=3)]), got)
    computed = core.stats().num_prompt_tokens  # now top-8 rows from 20 on are kept: a second ask computes the tail only
    again = run(core, [request("w", prompt, logprobs=TOP8_LATE, max_new_tokens=3)])
    assert core.stats().num_prompt_tokens - computed == 6
    _assert_same({"w": got["y"]}, again)


def test_processed_mode_keeps_no_prompt_rows(make_core):
    prompt = BASE[:70]
    core = make_core(logprobs_mode="processed")
    run(core, [request("x", prompt, logprobs=TOP5, max_new_tokens=2)])
    computed = core.stats().num_prompt_tokens
    run(core, [request("y", prompt, logprobs=TOP5, max_new_tokens=2)])
    assert core.stats().num_prompt_tokens - computed == 70  # rows from position 0 wanted: nothing cached could serve


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunk", [40, 1024])
def test_a_group_arriving_together_computes_its_shared_prefix_once(make_core, overlap, chunk):
    """8 requests sharing a 4-block prefix arrive in one step whose budget would admit them all (or,
    chunk 40, the first's prefill spans two steps): the first computes the prefix, the others wait
    for its blocks to be committed (one step, planned ahead or not) and hit."""
    group = [request(f"g{i}", BASE[:64] + prompt_of(100 + i, 5), ignore_eos=True, max_new_tokens=4) for i in range(8)]
    off, on, core = both(make_core, group, chunked_prefill_size=chunk, overlap_decode=overlap)
    _assert_same(off, on)
    assert sorted(result.cached_tokens for result in on.values()) == [0] + [64] * 7
    assert core.stats().num_prompt_tokens == 69 + 7 * 5  # the prefix once, each tail once
    assert_all_free(core)


def test_a_waiting_group_hits_in_the_step_planned_after_its_prefix_is_launched(make_core):
    """Planned ahead, the waiting requests hit the prefix in the step right after the one computing
    it: blocks count as committed once that step is launched (every later step reads their KV), so
    no step runs only the first request's decode while the others wait for its results."""
    group = [request(f"g{i}", BASE[:64] + prompt_of(100 + i, 5), ignore_eos=True, max_new_tokens=4) for i in range(8)]
    core = make_core(chunked_prefill_size=1024, overlap_decode=True)
    for each in group:
        core.add(each)
    first_call: dict[str, int] = {}
    for call in range(1, 40):
        for output in core.step():
            if output.new_token_ids:
                first_call.setdefault(output.rid, call)
        if not core.has_work():
            break
    assert first_call.pop("g0") == 1  # the prefix and its tail, alone in the first step
    assert set(first_call.values()) == {2}  # the seven others: a hit in the step planned ahead
    assert core.stats().num_prompt_tokens == 69 + 7 * 5
    assert_all_free(core)
