"""`n` > 1: one request whose choices are forked after one prefill (policy + block manager), on the
tiny CPU model, plain and DSpark. Every choice must equal a request of its own with the same seed,
while the prompt is computed once (plus each fork's short tail)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from contracts.detokenizer import Finish, FinishType
from contracts.scheduler import ForkedChoice, LogprobParams
from services.scheduler.block_manager import BlockManager
from test_dspark_core import dspark  # noqa: F401 (fixture)
from test_scheduler_core import ALL_LOGPROBS, prompt_of, request, run
from test_speculative_loop import _assert_same

PROMPT = prompt_of(77, 37)  # 2 full blocks of 16 shared, a tail of 5 recomputed per fork
SEEDS = (11, 2**40 + 3, 987654321, 5)
FLAT = LogprobParams(return_logprob=True, logprob_start_len=3, top_logprobs_num=4, flat_prompt_top_logprobs=True)


def forked(rid, prompt, seeds, **options):
    """Choice 0 is `rid` (seed seeds[0]); choice j is `rid.j`."""
    first = request(rid, prompt, seed=seeds[0], **options)
    choices = tuple(ForkedChoice(f"{rid}.{j}", "detok", seed) for j, seed in enumerate(seeds[1:], start=1))
    return dataclasses.replace(first, choices=choices)


def alone(rid, prompt, seeds, **options):
    """The same choices as separate requests."""
    return [request(rid if j == 0 else f"{rid}.{j}", prompt, seed=seed, **options) for j, seed in enumerate(seeds)]


def _assert_flat_same(expected, got) -> None:
    for rid, result in expected.items():
        if result.flat is not None:
            np.testing.assert_allclose(got[rid].flat[0], result.flat[0], atol=1e-4)
            np.testing.assert_array_equal(got[rid].flat[1], result.flat[1])
            assert got[rid].flat[2] == result.flat[2]


CASES = {
    "greedy": dict(temperature=0.0, logprobs=ALL_LOGPROBS),
    "sampled": dict(temperature=1.0, logprobs=ALL_LOGPROBS),
    "sampled-flat": dict(temperature=0.8, top_k=50, logprobs=FLAT),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunk", [16, 256])
def test_forked_choices_equal_separate_seeded_requests(make_core, case, chunk):
    options = dict(CASES[case], max_new_tokens=9, ignore_eos=True)
    expected = run(make_core(chunked_prefill_size=chunk), alone("r", PROMPT, SEEDS, **options))
    core = make_core(chunked_prefill_size=chunk)
    got = run(core, [forked("r", PROMPT, SEEDS, **options)])
    _assert_same(expected, got)
    _assert_flat_same(expected, got)
    if case != "greedy":
        assert len({tuple(r.tokens) for r in got.values()}) == len(SEEDS), "seeded choices are distinct"
    # the prompt once, then each fork's tail past the 2 shared blocks of 16
    assert core.stats().num_prompt_tokens == len(PROMPT) + 3 * (len(PROMPT) - 32)
    assert (core.stats().num_prefix_queries, core.stats().num_prefix_hits) == (4 * len(PROMPT), 3 * 32)
    assert core.stats().num_free_blocks == core.stats().num_blocks


@pytest.mark.parametrize("case", ["greedy", "sampled"])
@pytest.mark.parametrize("chunk", [16, 256])
def test_forked_choices_under_dspark_equal_separate_requests(make_core, dspark, case, chunk):  # noqa: F811
    options = dict(CASES[case], max_new_tokens=9, ignore_eos=True)
    # Each choice run solo, so its prefill chunks are the fork's (16: 16 + 16 + 5; 256: one). Sampled
    # DSpark output moves with float rounding here: the residual max(p - q, 0) of the random drafter's
    # q and the random target's p, two nearly equal flat distributions, amplifies it, so separate
    # requests batched under a shared chunk budget (other chunk boundaries) give other samples.
    expected = {}
    for each in alone("r", PROMPT, SEEDS, **options):
        expected |= run(make_core(chunked_prefill_size=chunk, proposer=dspark()), [each])
    core = make_core(chunked_prefill_size=chunk, proposer=dspark())
    got = run(core, [forked("r", PROMPT, SEEDS, **options)])
    _assert_same(expected, got)
    assert all(got[rid].spec_verify_ct == expected[rid].spec_verify_ct for rid in expected)
    assert core.stats().num_drafted_tokens > 0
    assert core.stats().num_prompt_tokens == len(PROMPT) + 3 * (len(PROMPT) - 32)
    assert core.stats().num_free_blocks == core.stats().num_blocks


def test_short_prompt_forks_share_nothing_but_still_match(make_core):
    prompt = prompt_of(5, 9)  # shorter than a block: each fork computes the whole prompt
    options = dict(temperature=1.0, logprobs=ALL_LOGPROBS, max_new_tokens=5, ignore_eos=True)
    expected = run(make_core(), alone("s", prompt, SEEDS, **options))
    core = make_core()
    _assert_same(expected, run(core, [forked("s", prompt, SEEDS, **options)]))
    assert core.stats().num_prompt_tokens == 4 * len(prompt)


def test_abort_of_one_choice_leaves_the_others_and_frees_every_block(make_core):
    options = dict(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    expected = run(make_core(), alone("r", PROMPT, SEEDS, **options))
    core = make_core()
    got = run(core, [forked("r", PROMPT, SEEDS, **options)], abort_at={4: ["r.2"], 7: ["r"]})
    assert got["r.2"].finish.type == FinishType.ABORT and got["r"].finish.type == FinishType.ABORT
    assert got["r.2"].tokens == expected["r.2"].tokens[: len(got["r.2"].tokens)]
    for rid in ("r.1", "r.3"):
        assert got[rid].tokens == expected[rid].tokens and got[rid].finish == Finish(FinishType.LENGTH)
    assert core.stats().num_free_blocks == core.stats().num_blocks


def test_choice_0_aborted_before_its_prefill_is_done_hands_the_forks_on(make_core):
    options = dict(temperature=1.0, max_new_tokens=6, ignore_eos=True, logprobs=ALL_LOGPROBS)
    expected = run(make_core(chunked_prefill_size=8), alone("r", PROMPT, SEEDS, **options))
    core = make_core(chunked_prefill_size=8)
    got = run(core, [forked("r", PROMPT, SEEDS, **options)], abort_at={2: ["r", "r.3"]})  # mid-prefill
    assert got["r"].finish.type == FinishType.ABORT and got["r"].tokens == []
    assert got["r.3"].finish.type == FinishType.ABORT and got["r.3"].tokens == []
    _assert_same({k: v for k, v in expected.items() if k in ("r.1", "r.2")}, {k: got[k] for k in ("r.1", "r.2")})
    assert core.stats().num_free_blocks == core.stats().num_blocks


def test_preempted_forks_recompute_and_still_match(make_core):
    options = dict(temperature=1.0, max_new_tokens=20, ignore_eos=True, logprobs=ALL_LOGPROBS)
    expected = run(make_core(), alone("r", PROMPT, SEEDS, **options))
    # 7 blocks of 16: the 2 shared + 4 tails (37 -> 57 tokens: 2 blocks each) do not fit: the newest are preempted
    core = make_core(num_blocks=7)
    got = run(core, [forked("r", PROMPT, SEEDS, **options)])
    assert core.num_preemptions > 0
    _assert_same(expected, got)
    assert core.stats().num_free_blocks == core.stats().num_blocks


def test_a_prompt_too_big_for_the_cache_fails_every_choice(make_core):
    core = make_core(num_blocks=2)
    got = run(core, [forked("big", prompt_of(3, 40), SEEDS, max_new_tokens=3)])
    assert set(got) == {"big", "big.1", "big.2", "big.3"}
    assert all(r.finish.type == FinishType.ABORT and "KV cache" in r.finish.message for r in got.values())


def test_has_room_counts_the_shared_blocks_once(make_core):
    core = make_core(num_blocks=5)
    # 37 tokens + 1: 3 blocks; each more choice needs only its tail block past the 2 shared
    assert core.has_room(37, num_choices=3)
    assert not core.has_room(37, num_choices=4)


def test_block_manager_refcounts_shared_blocks():
    blocks = BlockManager(num_blocks=6, block_size=4)
    blocks.allocate("p", 10)  # 3 blocks
    blocks.fork("p", "c", 8)  # the first 2, shared
    blocks.allocate("c", 10)  # + its own tail block
    assert blocks.block_table("c")[:2].tolist() == blocks.block_table("p")[:2].tolist()
    assert blocks.block_table("c")[2] != blocks.block_table("p")[2]
    assert blocks.num_free_blocks == 2
    blocks.free("p")  # the shared blocks stay with c
    assert blocks.num_free_blocks == 3
    blocks.free("c")
    assert blocks.num_free_blocks == 6
    with pytest.raises(ValueError):
        blocks.fork("c", "d", 3)


def test_waiting_forks_give_up_their_shared_blocks_before_a_lone_request_is_aborted(make_core):
    """Choice 0 preempted while its forks wait: the forks alone hold the prompt's blocks. A request
    that then runs alone and needs a block must get theirs (the forks recompute), not an abort."""
    older = request("old", prompt_of(8, 5), max_new_tokens=60, ignore_eos=True)
    options = dict(temperature=1.0, max_new_tokens=40, ignore_eos=True)
    expected = run(make_core(), [older, *alone("r", PROMPT, SEEDS[:3], **options)])
    core = make_core(num_blocks=5, max_running_requests=2)
    got = run(core, [older, forked("r", PROMPT, SEEDS[:3], **options)])
    assert core.num_preemptions > 0
    assert all(r.finish == Finish(FinishType.LENGTH) for r in got.values()), {k: r.finish for k, r in got.items()}
    _assert_same(expected, got)
    assert core.stats().num_free_blocks == core.stats().num_blocks


def test_preempted_forks_under_dspark_still_match(make_core, dspark):  # noqa: F811
    """Greedy: a re-prefill's other chunk boundaries cannot move a sample (see the DSpark test above)."""
    options = dict(temperature=0.0, max_new_tokens=20, ignore_eos=True, logprobs=ALL_LOGPROBS)
    expected = run(make_core(proposer=dspark()), alone("r", PROMPT, SEEDS, **options))
    core = make_core(num_blocks=7, proposer=dspark())
    got = run(core, [forked("r", PROMPT, SEEDS, **options)])
    assert core.num_preemptions > 0 and core.stats().num_drafted_tokens > 0
    _assert_same(expected, got)
    assert core.stats().num_free_blocks == core.stats().num_blocks
