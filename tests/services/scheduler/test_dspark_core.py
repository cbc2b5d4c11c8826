"""The scheduler core with a real DSpark proposer (random drafter weights) on the tiny CPU model.

Drafts from random weights are mostly rejected, so these tests pin down the plumbing — context
injection, proposing, q kept between steps, verify rows mapped to output tokens — against plain
decoding: identical greedy output and every logprob within 1e-4, in static and compact modes.
(test_speculative_loop.py covers fully accepted blocks with an oracle proposer.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from contracts.scheduler import LogprobParams
from services.scheduler.spec.dspark import DSparkProposer
from services.scheduler.spec.dspark_config import draft_config_for_target
from services.scheduler.spec.dspark_loader import empty_drafter, fill_random_weights
from test_scheduler_core import prompt_of, request, run
from test_speculative_loop import _assert_same

MASK_TOKEN = 5


@pytest.fixture(scope="module")
def dspark(tiny_runner):
    def make(block_size: int = 4, confidence: bool = True) -> DSparkProposer:
        config = draft_config_for_target(
            tiny_runner.config, num_draft_layers=1, mask_token_id=MASK_TOKEN, block_size=block_size, markov_rank=8,
            enable_confidence_head=confidence,
        )  # fmt: skip
        drafter = empty_drafter(config, tiny_runner.model.model.embed_tokens, tiny_runner.lm_head_weight)
        fill_random_weights(drafter, seed=3)
        return DSparkProposer(drafter.eval(), tiny_runner.num_blocks, tiny_runner.block_size)

    return make


def _mixed_requests(num: int) -> list:
    """Greedy requests of many lengths, some with every kind of logprob (different k and ids)."""
    kinds = [
        None,
        LogprobParams(return_logprob=True, top_logprobs_num=5, token_ids_logprob=(7, 3, 1999)),
        LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=2),
        LogprobParams(return_logprob=True, logprob_start_len=3, top_logprobs_num=4, flat_prompt_top_logprobs=True),
    ]
    return [
        request(f"r{i}", prompt_of(300 + i, 4 + 2 * i), max_new_tokens=4 + i % 4, ignore_eos=True, logprobs=kinds[i % 4])
        for i in range(num)
    ]


REQUESTS = _mixed_requests(20)
JOINS = {3: REQUESTS[12:16], 6: REQUESTS[16:]}  # arrivals mid-flight: prefill chunks beside verify blocks


@pytest.fixture(scope="module")
def plain_mixed(tiny_runner):
    from services.scheduler.build import core_for

    return run(core_for(tiny_runner, max_running_requests=64, chunked_prefill_size=48), REQUESTS[:12], JOINS)


@pytest.mark.parametrize("verify_mode", ["static", "compact"])
def test_dspark_greedy_equals_plain_greedy_with_every_logprob(make_core, dspark, plain_mixed, verify_mode):
    requests, joins, plain = REQUESTS, JOINS, plain_mixed
    linear = ((1, 1.0), (2, 1.05))  # each row costs 5% of a step: the budget cuts blocks
    core = make_core(chunked_prefill_size=48, proposer=dspark(), verify_mode=verify_mode, verify_step_cost=linear)
    spec = run(core, requests[:12], joins)
    _assert_same(plain, spec)
    for rid, result in plain.items():
        if result.flat is not None:
            np.testing.assert_allclose(spec[rid].flat[0], result.flat[0], atol=1e-4)
            np.testing.assert_array_equal(spec[rid].flat[1], result.flat[1])
    stats = core.stats()
    assert stats.num_drafted_tokens > 0
    assert all(spec[r.rid].spec_verify_ct >= 1 for r in requests)
    if verify_mode == "compact":  # fewer drafts verified than proposed: the head decided
        assert stats.num_drafted_tokens < 3 * sum(r.spec_verify_ct for r in spec.values())


def test_compact_without_a_confidence_head_is_refused(make_core, dspark):
    with pytest.raises(ValueError, match="confidence head"):
        make_core(proposer=dspark(confidence=False), verify_mode="compact")
    make_core(proposer=dspark(confidence=False), verify_mode="static")


def test_dspark_blocks_of_requests_asking_the_same_logprobs_share_one_query(make_core, dspark, monkeypatch):
    """Every request asks the same: each verify step's output rows are one query (a block of
    1 + accepted drafts rows a request, cut per request after the readback), equal to plain decoding's."""
    from test_scheduler_core import _output_queries_per_step

    params = LogprobParams(return_logprob=True, top_logprobs_num=3, token_ids_logprob=(7, 3))
    requests = [request(f"u{i}", prompt_of(700 + i, 5 + i), max_new_tokens=6 + i, ignore_eos=True, logprobs=params) for i in range(5)]
    plain = run(make_core(chunked_prefill_size=48), requests)
    core = make_core(chunked_prefill_size=48, proposer=dspark())
    queries = _output_queries_per_step(core, monkeypatch)
    spec = run(core, requests)
    _assert_same(plain, spec)
    assert core.stats().num_drafted_tokens > 0 and [5] in queries and all(len(q) <= 1 for q in queries)


def test_dspark_seeded_sampling_is_reproducible_alone_and_in_a_busy_batch(make_core, dspark):
    prompt = prompt_of(5, 10)
    sampled = dict(temperature=1.0, seed=1234, max_new_tokens=10, ignore_eos=True)
    alone = run(make_core(proposer=dspark()), [request("s", prompt, **sampled)])["s"].tokens
    others = [request(f"o{i}", prompt_of(40 + i, 6 + i), temperature=0.8, max_new_tokens=6) for i in range(6)]
    busy = run(make_core(proposer=dspark(), chunked_prefill_size=8), [*others[:3], request("s", prompt, **sampled)], {3: others[3:]})
    assert busy["s"].tokens == alone and len(alone) == 10
    assert run(make_core(proposer=dspark()), [request("s", prompt, **{**sampled, "seed": 99})])["s"].tokens != alone


def test_dspark_logprobs_of_sampled_tokens_are_the_target_rows(make_core, dspark, tiny_runner):
    from plain_forward import reference_logprobs

    params = LogprobParams(return_logprob=True, top_logprobs_num=5)
    result = run(make_core(proposer=dspark()), [request("a", prompt_of(9, 12), temperature=1.0, seed=5, max_new_tokens=12, ignore_eos=True, logprobs=params)])["a"]
    reference = reference_logprobs(tiny_runner, prompt_of(9, 12) + result.tokens)[12 - 1 : -1]  # [n, V]
    expected = reference.gather(1, torch.tensor(result.tokens)[:, None])[:, 0].numpy()
    np.testing.assert_allclose(result.cat("output_token"), expected, atol=1e-4)
    np.testing.assert_allclose(result.cat("output_top_values"), reference.topk(5).values.numpy(), atol=1e-4)


def test_processed_logprobs_with_dspark_are_the_sampler_distribution(make_core, dspark, tiny_runner):
    from plain_forward import reference_logprobs
    from services.scheduler.sampler import sampling_weights

    params = LogprobParams(return_logprob=True, top_logprobs_num=3)
    req = request("a", prompt_of(16, 8), max_new_tokens=8, temperature=0.5, seed=1, top_k=5, logprobs=params)
    result = run(make_core(logprobs_mode="processed", proposer=dspark()), [req])["a"]
    rows = reference_logprobs(tiny_runner, prompt_of(16, 8) + result.tokens)[8 - 1 : -1]  # log-softmax: shift-invariant
    weights = sampling_weights(rows, [req.sampling] * len(rows))
    probs = weights / weights.sum(dim=1, keepdim=True)  # the filters remove mass; logprobs renormalise
    expected = probs.gather(1, torch.tensor(result.tokens)[:, None])[:, 0].log().numpy()
    np.testing.assert_allclose(result.cat("output_token"), expected, atol=1e-4)


def test_every_prefill_chunk_reaches_the_drafters_context(make_core, dspark):
    """A prompt prefilled in chunks gives the drafter the same context KV as one prefilled whole:
    the chunks before the prompt's last sample nothing, and their rows are injected all the same."""
    prompt = prompt_of(21, 200)
    caches = []
    for chunk in (256, 48):  # one step; five steps, four of which sample nothing
        proposer = dspark()
        run(make_core(chunked_prefill_size=chunk, proposer=proposer), [request("a", prompt, max_new_tokens=1, ignore_eos=True)])
        caches.append(proposer.kv_cache.kv.clone())
    whole, chunked = caches
    written = whole.flatten(4).abs().sum(-1) > 0  # [layers, k/v, blocks, slot in block]: rows the prompt wrote
    assert written.sum() == whole.shape[0] * 2 * len(prompt)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_verify_blocks_output_rows_travel_as_cuts_of_the_steps_columns(make_core, dspark):
    """Several rows a request a step (an anchor and its accepted drafts), some kept short by a
    finish: the batch's columns cut from the step's equal the ones joined per request."""
    from test_wire_columns import TOP20, assert_columns_agree

    core = make_core(chunked_prefill_size=48, proposer=dspark())
    for i in range(6):
        core.add(request(f"v{i}", prompt_of(500 + i, 6 + i), max_new_tokens=5 + 3 * i, ignore_eos=True, logprobs=TOP20))
    taken, multi_row = 0, False
    while core.has_work():
        outputs = core.step()
        multi_row |= any(o.logprobs is not None and o.logprobs.output is not None and o.logprobs.output.num_rows > 1 for o in outputs)
        taken += assert_columns_agree(outputs)["source"]
    assert taken > 0 and multi_row
