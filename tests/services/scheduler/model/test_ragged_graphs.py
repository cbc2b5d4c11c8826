"""The ragged-graph path's CPU twin: steps padded to (sequence rung, token rung, block_m) keys and run
eagerly on the varlen torch twin equal the unpadded eager forward, and padding writes only the trash
block. On CUDA the same buffers are replayed from captured graphs
(ops/bench/gpu_attention_check.py, section "ragged_graph", checks those against eager on an H200)."""

from __future__ import annotations

import bisect

import dataclasses

import numpy as np
import pytest
import torch

from contracts.scheduler import LogprobParams, SamplingParams
from services.models import RANDOM_TINY_MODEL
from services.scheduler.build import core_for
from services.scheduler.core import SchedulerCore
from services.scheduler.model.loader import load_model_runner
from services.scheduler.model.ragged_graphs import RaggedGraphRunner, RaggedKey, padded_tiles, seq_ladder, token_ladder
from services.scheduler.request import SchedulerRequest

BLOCK_SIZE = 4
MAX_BLOCKS = 16
SEQ_LADDER = (1, 2, 4, 8)
TOKEN_LADDER = (8, 16, 32, 64)
PROMPTS = (40, 13, 14, 6, 25)  # tokens already cached per sequence before the step under test


def with_host_lengths(batch):
    starts = batch.query_start_loc.tolist()
    query_lens = tuple(b - a for a, b in zip(starts, starts[1:]))
    return dataclasses.replace(batch, host_query_lens=query_lens, host_seq_lens=tuple(batch.seq_lens.tolist()))


def prefilled_runner(make_pager):
    pager = make_pager(num_seqs=len(PROMPTS) + 1, max_blocks_per_seq=MAX_BLOCKS, block_size=BLOCK_SIZE, seed=4)
    runner = load_model_runner(RANDOM_TINY_MODEL, num_kv_blocks=pager.num_blocks, kv_block_size=BLOCK_SIZE)
    runner.forward(pager.batch([(s, [7 + s] * n, 0) for s, n in enumerate(PROMPTS)]))
    return runner, pager


# (sequence, number of new tokens) per step; each continues its sequence's cached prompt, and
# sequence 5 has nothing cached (a whole first chunk).
STEPS = {
    "mixed": [(0, 1), (1, 9), (2, 1), (5, 12), (3, 1)],  # decodes beside two prefill chunks
    "chunks_with_context": [(0, 20), (4, 17)],  # 37 tokens: pads to 64
    "compact_verify": [(0, 3), (1, 1), (2, 5), (3, 2), (4, 4)],  # short ragged verify blocks
    "one_chunk": [(5, 16)],  # exactly a token rung; sequences 1 -> 1 (+ the empty one)
}


def step_batch(pager, step, capture_layers=()):
    chunks = [(s, [100 + 3 * s + i for i in range(n)], PROMPTS[s] if s < len(PROMPTS) else 0) for s, n in step]
    return with_host_lengths(pager.batch(chunks, capture_layers=capture_layers))


def test_padded_tiles_cover_the_step_then_point_at_the_empty_sequence() -> None:
    key = RaggedKey(num_seqs=4, num_tokens=64, block_m=8)
    tiles = padded_tiles([1, 20, 3], [5, 30, 3], key)
    assert tiles.shape == (2, 64 // 8 + 4) and tiles.dtype == torch.int32
    real = [(b, f) for b, f in tiles.T.tolist() if b != 4]
    assert sorted(real) == [(0, 0), (1, 0), (1, 8), (1, 16), (2, 0)]
    assert tiles.T.tolist()[len(real) :] == [[4, 0]] * (key.num_tiles - len(real))


def test_worst_case_tile_count_holds_any_step_of_the_key() -> None:
    key = RaggedKey(num_seqs=8, num_tokens=64, block_m=8)
    query_lens = [9, 9, 9, 9, 9, 9, 9, 1]  # 64 tokens, each sequence one token past a tile
    assert padded_tiles(query_lens, query_lens, key).shape[1] == key.num_tiles == 16


def test_invariant_keys_carry_a_power_of_two_split_count_the_plan_launches(make_pager) -> None:
    """`--deterministic` on CUDA: a graph key holds its key-split count (from the step's longest
    sequence, a power of two so few keys), and the plan it builds launches that many programs a tile."""
    from services.scheduler.model.batch_invariant import set_batch_invariant
    from services.scheduler.model.kv_splits import KV_SPLIT_TOKENS

    runner, pager = prefilled_runner(make_pager)
    set_batch_invariant(runner.model, True)
    graphs = RaggedGraphRunner(runner.model, runner.kv_cache, SEQ_LADDER, TOKEN_LADDER, MAX_BLOCKS, capture=False,
                               use_kernel=False, split_sms=132)  # fmt: skip
    batch = step_batch(pager, STEPS["mixed"])
    longest = max(batch.host_seq_lens)
    key = graphs.key(batch)
    assert key.kv_splits == 1 << (-(-longest // KV_SPLIT_TOKENS) - 1).bit_length()
    assert graphs._plan(key).num_kv_splits == key.kv_splits and graphs.key(dataclasses.replace(
        batch, host_seq_lens=(3 * KV_SPLIT_TOKENS,) + batch.host_seq_lens[1:])).kv_splits == 4  # fmt: skip
    set_batch_invariant(runner.model, False)
    assert graphs.key(batch).kv_splits == 1


def test_seq_ladder_stops_at_the_most_running_requests() -> None:
    assert seq_ladder(64) == (1, 2, 4, 8, 16, 32, 64) and seq_ladder(100) == (1, 2, 4, 8, 16, 32, 64, 100)


def test_token_ladder_stops_at_the_chunk_budget() -> None:
    assert token_ladder(2048) == (64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert token_ladder(1000) == (64, 128, 256, 384, 512, 768, 1000)
    assert token_ladder(8192) == (*token_ladder(2048), 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192)
    assert token_ladder(3000) == (*token_ladder(2048), 2560, 3000)


@pytest.mark.parametrize("budget", [2048, 3000, 8192, 32768])
def test_past_1024_tokens_no_step_pads_by_more_than_a_quarter(budget) -> None:
    ladder = token_ladder(budget)
    for tokens in range(1025, budget + 1, 7):
        rung = ladder[bisect.bisect_left(ladder, tokens)]
        assert tokens <= rung <= 1.25 * tokens, (tokens, rung)


@pytest.mark.parametrize("capture_layers", [(), (1, 3)])
@pytest.mark.parametrize("name", sorted(STEPS))
def test_padded_twin_equals_the_unpadded_eager_forward(make_pager, name, capture_layers) -> None:
    runner, pager = prefilled_runner(make_pager)
    batch = step_batch(pager, STEPS[name], capture_layers)
    before = runner.kv_cache.kv.clone()
    eager = runner.forward(batch)  # the ragged SDPA groups, unpadded: the reference
    eager_kv = runner.kv_cache.kv.clone()
    runner.kv_cache.kv.copy_(before)
    graphs = RaggedGraphRunner(runner.model, runner.kv_cache, SEQ_LADDER, TOKEN_LADDER, MAX_BLOCKS, capture=False,
                               use_kernel=False, capture_layers=capture_layers)  # fmt: skip
    with torch.inference_mode():
        padded = graphs.run(batch)
    key = graphs.key(batch)
    assert key.num_tokens >= batch.num_tokens and key.num_seqs >= batch.num_seqs
    assert padded.logits is None and padded.hidden_states.shape == eager.hidden_states.shape
    torch.testing.assert_close(padded.hidden_states, eager.hidden_states, atol=1e-5, rtol=1e-5)
    if capture_layers:
        torch.testing.assert_close(padded.captured, eager.captured, atol=1e-5, rtol=1e-5)
    real = slice(0, runner.num_blocks)  # every block but the trash block
    torch.testing.assert_close(runner.kv_cache.kv[:, :, real], eager_kv[:, :, real], atol=1e-5, rtol=1e-5)


def test_consecutive_steps_of_one_key_leave_no_stale_rows(make_pager) -> None:
    # A wide step then a narrow one of the same key: the second must not see the first's sequences.
    runner, pager = prefilled_runner(make_pager)
    graphs = RaggedGraphRunner(runner.model, runner.kv_cache, SEQ_LADDER, TOKEN_LADDER, MAX_BLOCKS, capture=False, use_kernel=False)
    wide, narrow = step_batch(pager, [(0, 3), (1, 1), (2, 5), (3, 2)]), step_batch(pager, [(4, 5), (1, 3), (2, 1)])
    assert graphs.key(wide) == graphs.key(narrow)
    kv = runner.kv_cache.kv.clone()
    want = runner.forward(narrow).hidden_states
    runner.kv_cache.kv.copy_(kv)
    with torch.inference_mode():
        graphs.run(wide)
        runner.kv_cache.kv.copy_(kv)
        got = graphs.run(narrow).hidden_states
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_runner_routes_ragged_steps_with_host_lengths_through_the_twin(make_pager) -> None:
    runner, pager = prefilled_runner(make_pager)
    runner.prepare_ragged_graphs(SEQ_LADDER, TOKEN_LADDER, MAX_BLOCKS, capture=False)
    assert runner.ragged_graphs is not None and not runner.ragged_graphs.graphs  # CPU: nothing captured
    calls = []
    run = runner.ragged_graphs.run
    runner.ragged_graphs.run = lambda batch: calls.append(batch.num_tokens) or run(batch)
    mixed = step_batch(pager, STEPS["mixed"])
    runner.forward(mixed)
    runner.forward(dataclasses.replace(mixed, host_query_lens=None))  # no host lengths: eager, no readback
    runner.forward(step_batch(pager, [(0, 20), (1, 40), (5, 10)]))  # 70 tokens, past the largest rung: eager
    runner.forward(step_batch(pager, [(0, 1), (1, 1)]))  # uniform: the decode path
    assert calls == [mixed.num_tokens]


def test_capture_needs_the_varlen_kernel(make_pager) -> None:
    runner, _ = prefilled_runner(make_pager)
    with pytest.raises(ValueError, match="varlen kernel"):
        runner.prepare_ragged_graphs(capture=True)


def test_a_failed_capture_runs_the_step_eagerly_and_leaves_its_key_to_the_eager_path(make_pager) -> None:
    runner, pager = prefilled_runner(make_pager)
    graphs = RaggedGraphRunner(runner.model, runner.kv_cache, SEQ_LADDER, TOKEN_LADDER, MAX_BLOCKS, capture=True, use_kernel=False)

    def refuse(key):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs._capture = refuse
    batch = step_batch(pager, STEPS["mixed"])
    kv = runner.kv_cache.kv.clone()
    want = runner.forward(batch).hidden_states
    runner.kv_cache.kv.copy_(kv)
    assert graphs.fits(batch)
    with torch.inference_mode():
        got = graphs.run(batch).hidden_states
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert graphs.failed == {graphs.key(batch)} and not graphs.fits(batch)


def test_start_up_stops_at_a_capture_out_of_memory_and_skips_other_failures(make_pager) -> None:
    """Mid-serving a failed capture leaves its key eager (above); at start-up running out of memory
    raises (a server that short would fail its first steps), any other failure skips the key."""
    runner, _ = prefilled_runner(make_pager)
    graphs = RaggedGraphRunner(runner.model, runner.kv_cache, SEQ_LADDER, TOKEN_LADDER, MAX_BLOCKS, capture=True, use_kernel=False)
    tried = []

    def refuse(key):
        tried.append(key)
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs._capture = refuse
    keys = graphs.prefill_keys()
    assert graphs.capture_keys(keys, "prefill") == 0 and tried == keys and graphs.failed == set(keys)
    graphs = RaggedGraphRunner(runner.model, runner.kv_cache, SEQ_LADDER, TOKEN_LADDER, MAX_BLOCKS, capture=True, use_kernel=False)
    tried.clear()

    def out_of_memory(key):
        tried.append(key)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB")

    graphs._capture = out_of_memory
    with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate"):
        graphs.capture_keys(keys, "prefill")
    assert tried == keys[:1]


def test_past_max_graphs_new_keys_are_not_taken(make_pager) -> None:
    runner, pager = prefilled_runner(make_pager)
    graphs = RaggedGraphRunner(runner.model, runner.kv_cache, SEQ_LADDER, TOKEN_LADDER, MAX_BLOCKS, capture=True,
                               use_kernel=False, max_graphs=0)  # fmt: skip
    assert not graphs.fits(step_batch(pager, STEPS["mixed"]))


def serve(runner, prompts: dict[str, list[int]], joins_at: dict[str, int]) -> dict[str, tuple[list[int], np.ndarray]]:
    """Greedy tokens and prompt logprobs per request, requests joining at their step (mixed steps)."""
    core = core_for(runner, max_running_requests=8, chunked_prefill_size=24, logprobs_mode="raw", seed=0)
    params = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    prompt_lp: dict[str, list[float]] = {rid: [] for rid in prompts}
    for step in range(200):
        for rid, at in joins_at.items():
            if at == step:
                core.add(SchedulerRequest(rid, np.asarray(prompts[rid], np.int32), "d", sampling, params))
        if step > max(joins_at.values()) and not core.has_work():
            return {rid: (tokens[rid], np.asarray(prompt_lp[rid])) for rid in prompts}
        for output in core.step():
            tokens[output.rid].extend(output.new_token_ids)
            if output.logprobs is not None and output.logprobs.prompt is not None:
                prompt_lp[output.rid].extend(np.asarray(output.logprobs.prompt.token, np.float64).tolist())
    raise AssertionError("core did not finish")


def test_a_core_serving_through_the_twin_matches_the_eager_core() -> None:
    runner = load_model_runner(RANDOM_TINY_MODEL, num_kv_blocks=256, kv_block_size=16)
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": rng.integers(3, 2048, 9 + 13 * i).tolist() for i in range(4)}
    joins_at = {"r0": 0, "r1": 1, "r2": 3, "r3": 4}
    eager = serve(runner, prompts, joins_at)
    runner.prepare_ragged_graphs(max_blocks_per_seq=8, capture=False)  # the twin gathers every table entry: keep it narrow
    taken = []
    run = runner.ragged_graphs.run
    runner.ragged_graphs.run = lambda batch: taken.append(batch.num_seqs) or run(batch)
    padded = serve(runner, prompts, joins_at)
    assert len(taken) >= 3 and max(taken) > 1  # chunks beside decodes went through the padded path
    for rid in prompts:
        assert padded[rid][0] == eager[rid][0]
        np.testing.assert_allclose(padded[rid][1], eager[rid][1], atol=1e-5, equal_nan=True)


def test_start_up_captures_every_prefill_key_once(make_pager, fake_cuda_capture) -> None:
    runner, pager = prefilled_runner(make_pager)
    graphs = RaggedGraphRunner(runner.model, runner.kv_cache, SEQ_LADDER, TOKEN_LADDER, MAX_BLOCKS, capture=True, use_kernel=False)
    keys = graphs.prefill_keys()
    block_m = keys[0].block_m
    assert block_m == graphs.max_tile_rows // graphs.group  # a chunk of that many tokens or more takes it
    assert {(k.num_seqs, k.num_tokens) for k in keys} == {(s, t) for s in SEQ_LADDER for t in TOKEN_LADDER if t >= max(s, block_m)}
    assert all(k.block_m == block_m for k in keys)
    # and one key of each smaller block_m, each the smallest that holds it: every kernel variant compiled at start-up
    smaller = graphs.block_size_keys()
    assert [k.block_m for k in smaller] == [1 << bits for bits in range(block_m.bit_length() - 1)]
    assert all(k.num_seqs == SEQ_LADDER[0] and k.num_tokens == min(t for t in TOKEN_LADDER if t >= k.block_m) for k in smaller)
    keys = keys + smaller
    assert graphs.capture_prefill_keys() == len(keys) and set(graphs.graphs) == set(keys)
    assert graphs.capture_prefill_keys() == 0  # captured already
    one_chunk = step_batch(pager, [(5, block_m)])  # a prefill chunk of block_m tokens: a captured key
    assert graphs.key(one_chunk) in graphs.graphs
    idle = RaggedGraphRunner(runner.model, runner.kv_cache, SEQ_LADDER, TOKEN_LADDER, MAX_BLOCKS, capture=False, use_kernel=False)
    assert idle.capture_prefill_keys() == 0 and not idle.graphs


def test_verify_keys_hold_every_compact_verify_step_and_start_up_captures_them(make_pager) -> None:
    runner, pager = prefilled_runner(make_pager)
    graphs = RaggedGraphRunner(runner.model, runner.kv_cache, SEQ_LADDER, TOKEN_LADDER, MAX_BLOCKS, capture=True, use_kernel=False,
                               max_graphs=16)  # fmt: skip
    graphs._capture = lambda key: graphs.graphs.__setitem__(key, None)  # the bookkeeping only
    width = 4
    keys = graphs.verify_keys(width)
    rng = np.random.default_rng(0)
    for _ in range(40):  # 1 .. 5 sequences of 1 .. width tokens (at least one verifying a draft)
        lens = rng.integers(1, width + 1, size=rng.integers(1, len(PROMPTS) + 1)).tolist()
        lens[0] = max(lens[0], 2)
        assert graphs.key(step_batch(pager, list(enumerate(lens)))) in keys, lens
    assert len(set(keys)) == len(keys) and all(k.num_tokens <= 64 for k in keys)
    assert graphs.capture_keys(keys, "verify") == len(keys) and set(graphs.graphs) == set(keys)
    assert len(keys) == 14 and graphs.capture_keys(graphs.prefill_keys(), "prefill") == 2  # up to max_graphs only


def test_a_uniform_verify_narrower_than_the_decode_graphs_takes_the_ragged_twin(make_pager) -> None:
    runner, pager = prefilled_runner(make_pager)
    narrow = step_batch(pager, [(0, 2), (1, 2), (2, 2)])  # `compact` cut every block to one draft
    kv = runner.kv_cache.kv.clone()
    want = runner.forward(narrow).hidden_states  # eager
    runner.kv_cache.kv.copy_(kv)
    runner.prepare_decode_graphs(ladder=(1, 2, 4), max_blocks_per_seq=MAX_BLOCKS, capture=False, query_lens=(1, 4))
    runner.prepare_ragged_graphs(SEQ_LADDER, TOKEN_LADDER, MAX_BLOCKS, capture=False)
    calls = []
    run = runner.ragged_graphs.run
    runner.ragged_graphs.run = lambda batch: calls.append(batch.num_tokens) or run(batch)
    got = runner.forward(narrow).hidden_states
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    runner.forward(step_batch(pager, [(0, 4), (1, 4)]))  # the captured width: the decode graphs
    runner.forward(step_batch(pager, [(0, 1), (1, 1)]))  # a decode: the decode graphs
    assert calls == [6]
