"""Ragged steps on the varlen path: the host-built tile map, the torch twin against a dense
reference and the SDPA groups, the runner's routing, and the Triton kernel itself, in Triton's CPU
interpreter (skipped without Triton; the test extras install it) and on CUDA (skipped without a GPU)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from services.models import RANDOM_TINY_MODEL
from services.scheduler.model import runner as runner_module
from services.scheduler.model.attention import (
    paged_attention,
    plan_attention,
    plan_varlen,
    query_tiles,
    tile_tokens,
    varlen_attention_torch,
)
from services.scheduler.model.loader import load_model_runner
from tests.services.scheduler.model.triton_interpreter import INTERPRETED, run_interpreted_cases

# (query lengths, seq lens): decodes beside a chunk with context, a whole prefill, a verify block
MIXES = [
    ([1, 5, 13, 1], [1, 9, 40, 77]),
    ([20], [20]),
    ([3, 70, 1], [3, 150, 33]),
    ([8, 2, 8, 1], [30, 8, 8, 2]),
]


def ragged_inputs(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=16, page=4, dtype=torch.float32, device="cpu"):
    """(query [T, Hq, D], key cache, value cache, query_start_loc, seq_lens, block_tables) on shuffled pages."""
    gen = torch.Generator().manual_seed(sum(seq_lens))
    width = max(-(-s // page) for s in seq_lens) + 1
    num_pages = len(seq_lens) * width
    caches = (torch.randn(num_pages, page, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    tables = torch.randperm(num_pages, generator=gen).view(len(seq_lens), width).to(torch.int32)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    tensors = (query, *caches, starts, torch.tensor(seq_lens, dtype=torch.int32), tables)
    return tuple(t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in tensors)


def dense_reference(query, key_cache, value_cache, starts, seq_lens, tables, scale):
    """Per sequence: its first seq_len keys, SDPA in float64 with a bottom-right causal mask."""
    outs = []
    page = key_cache.shape[1]
    for b, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[b] : starts[b + 1]].double().transpose(0, 1)  # [Hq, q_len, D]
        blocks = tables[b, : -(-seq_len // page)].long()
        k, v = (c[blocks].flatten(0, 1)[:seq_len].double().transpose(0, 1) for c in (key_cache, value_cache))
        k, v = (x.repeat_interleave(q.shape[0] // k.shape[0], 0) for x in (k, v))  # [Hq, L, D]
        q_len = q.shape[1]
        mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]  # [q_len, L]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(outs)  # [T, Hq, D]


def test_tile_tokens_fill_at_most_128_rows_and_no_more_than_the_longest_query() -> None:
    assert [tile_tokens(n, 4) for n in (1, 2, 5, 8, 128, 2048)] == [1, 2, 8, 8, 32, 32]
    assert tile_tokens(4096, 1) == 128 and tile_tokens(4096, 3) == 42 and tile_tokens(0, 4) == 1


def test_query_tiles_cover_every_query_once_heaviest_first() -> None:
    query_lens, seq_lens = [1, 70, 33, 1], [300, 70, 100, 5]
    tiles = query_tiles(query_lens, seq_lens, 32)
    covered = sorted((b, first + i) for b, first in tiles for i in range(min(32, query_lens[b] - first)))
    assert covered == [(b, i) for b, n in enumerate(query_lens) for i in range(n)]
    keys = [seq_lens[b] - query_lens[b] + min(first + 32, query_lens[b]) for b, first in tiles]
    assert keys == sorted(keys, reverse=True) and tiles[0] == (0, 0)


def test_plan_uses_the_host_lengths_and_agrees_with_a_readback(make_pager) -> None:
    pager = make_pager(num_seqs=3, max_blocks_per_seq=12, block_size=4)
    batch = pager.batch([(0, list(range(20)), 20), (1, [5], 12), (2, [6, 7, 8, 9], 10)])
    with_host = dataclasses.replace(batch, host_query_lens=(20, 1, 4), host_seq_lens=(40, 13, 14))
    plans = [plan_varlen(b, group=2) for b in (batch, with_host)]
    assert plans[0].block_m == plans[1].block_m == 32
    assert torch.equal(plans[0].tiles, plans[1].tiles) and plans[0].tiles.dtype == torch.int32
    assert plans[0].tiles.tolist() == [[0, 2, 1], [0, 0, 0]]  # one tile each; the 40-key chunk first


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (6, 2), (4, 4)])
@pytest.mark.parametrize(("query_lens", "seq_lens"), MIXES)
def test_torch_twin_matches_dense_reference(query_lens, seq_lens, num_heads, num_kv_heads) -> None:
    inputs = ragged_inputs(query_lens, seq_lens, num_heads, num_kv_heads)
    got = varlen_attention_torch(*inputs, 0.3)
    torch.testing.assert_close(got.double(), dense_reference(*inputs, 0.3), atol=1e-5, rtol=1e-5)


def prefilled_runner(make_pager):
    pager = make_pager(num_seqs=3, max_blocks_per_seq=12, block_size=4, seed=2)
    runner = load_model_runner(RANDOM_TINY_MODEL, num_kv_blocks=pager.num_blocks, kv_block_size=4)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (40, 13, 14)]
    runner.forward(pager.batch([(0, prompts[0][:20], 0), (1, prompts[1][:12], 0), (2, prompts[2][:10], 0)]))
    mixed = pager.batch([(0, prompts[0][20:], 20), (1, prompts[1][12:], 12), (2, prompts[2][10:], 10)])
    return runner, mixed  # mixed: a prefill chunk with context, a decode, a 4-token verify block


def test_model_on_the_varlen_twin_equals_the_sdpa_groups(make_pager) -> None:
    runner, mixed = prefilled_runner(make_pager)
    kv = runner.kv_cache.kv.clone()
    sdpa = runner.forward(mixed).hidden_states
    runner.kv_cache.kv.copy_(kv)
    with torch.inference_mode():
        varlen, _ = runner.model(mixed, runner.kv_cache, plan_varlen(mixed, group=2, use_kernel=False))
    torch.testing.assert_close(varlen, sdpa, atol=1e-5, rtol=1e-5)


def test_runner_sends_ragged_steps_to_the_varlen_plan_and_uniform_ones_elsewhere(make_pager, monkeypatch) -> None:
    runner, mixed = prefilled_runner(make_pager)
    planned = []

    def twin_plan(batch, group, use_kernel=True, **options):
        planned.append(batch.num_tokens)
        return plan_varlen(batch, group, use_kernel=False, **options)

    monkeypatch.setattr(runner_module, "plan_varlen", twin_plan)
    runner.ragged_kernel = True
    runner.forward(mixed)
    decode = dataclasses.replace(mixed, input_ids=mixed.input_ids[:3], positions=mixed.positions[:3],
                                 query_start_loc=torch.arange(4, dtype=torch.int32), slot_mapping=mixed.slot_mapping[:3])  # fmt: skip
    runner.forward(decode)  # one token each: uniform, not ragged
    assert planned == [mixed.num_tokens]


def test_sdpa_groups_and_varlen_twin_agree_on_one_layer(make_pager) -> None:
    # The same function the GPU check compares the kernel against: paged_attention with either plan.
    runner, mixed = prefilled_runner(make_pager)
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(mixed.num_tokens, 4, 32, generator=gen)
    caches = (runner.kv_cache.key_cache(0), runner.kv_cache.value_cache(0))
    sdpa = paged_attention(query, *caches, plan_attention(mixed, 4), 0.2)
    twin = paged_attention(query, *caches, plan_varlen(mixed, 2, use_kernel=False), 0.2)
    torch.testing.assert_close(twin, sdpa, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(INTERPRETED or importlib.util.find_spec("triton") is None, reason="needs Triton; runs the interpreter")
def test_kernel_in_the_triton_interpreter() -> None:
    """The interpreted cases below, in a child pytest whose Triton starts in interpreter mode."""
    run_interpreted_cases(__file__, timeout_s=120)


@pytest.mark.skipif(not INTERPRETED, reason="run by test_kernel_in_the_triton_interpreter")
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_n"), [(4, 2, 16), (8, 1, 64), (6, 2, 32)])
@pytest.mark.parametrize(("query_lens", "seq_lens"), MIXES)
def test_interpreted_kernel_matches_twin(query_lens, seq_lens, num_heads, num_kv_heads, block_n) -> None:
    from services.scheduler.model.triton_varlen import LaunchConfig, varlen_attention_triton

    inputs = ragged_inputs(query_lens, seq_lens, num_heads, num_kv_heads)
    block_m = tile_tokens(max(query_lens), num_heads // num_kv_heads)
    tiles = torch.tensor(query_tiles(query_lens, seq_lens, block_m), dtype=torch.int32).T.contiguous()
    got = varlen_attention_triton(*inputs, tiles, block_m, 0.3, LaunchConfig(block_n=block_n))
    torch.testing.assert_close(got, varlen_attention_torch(*inputs, 0.3), atol=1e-5, rtol=1e-5)


def padded_like_a_graph(inputs, num_padded_tokens: int, num_empty_seqs: int):
    """The inputs as a ragged graph pads them: tokens of no sequence at the end, empty sequences
    (query length 0, seq_len 0) after the real ones."""
    query, key_cache, value_cache, starts, seq_lens, tables = inputs
    query = torch.cat([query, torch.randn(num_padded_tokens, *query.shape[1:], generator=torch.Generator().manual_seed(1))])
    starts = torch.cat([starts, starts[-1:].repeat(num_empty_seqs)])
    seq_lens = torch.cat([seq_lens, torch.zeros(num_empty_seqs, dtype=seq_lens.dtype)])
    tables = torch.cat([tables, tables[:1].repeat(num_empty_seqs, 1)])
    return query, key_cache, value_cache, starts, seq_lens, tables


def test_twin_zeros_tokens_of_no_sequence_and_skips_empty_sequences() -> None:
    inputs = ragged_inputs(*MIXES[0])
    padded = padded_like_a_graph(inputs, num_padded_tokens=5, num_empty_seqs=2)
    got = varlen_attention_torch(*padded, 0.3)
    num_tokens = inputs[0].shape[0]
    torch.testing.assert_close(got[:num_tokens], varlen_attention_torch(*inputs, 0.3), atol=0, rtol=0)
    assert not got[num_tokens:].any()


@pytest.mark.skipif(not INTERPRETED, reason="run by test_kernel_in_the_triton_interpreter")
@pytest.mark.parametrize(("query_lens", "seq_lens"), MIXES)
def test_interpreted_kernel_on_a_padded_step(query_lens, seq_lens) -> None:
    # The ragged graphs' launch: a fixed grid of the key's worst-case tile count, the unused tiles
    # no-ops on the always-empty last sequence; padded tokens and sequences must not change real rows.
    from services.scheduler.model.ragged_graphs import RaggedKey, padded_tiles
    from services.scheduler.model.triton_varlen import varlen_attention_triton

    inputs = ragged_inputs(query_lens, seq_lens)
    num_tokens, num_seqs = sum(query_lens), len(query_lens)
    key = RaggedKey(num_seqs=num_seqs + 1, num_tokens=num_tokens + 5, block_m=tile_tokens(max(query_lens), 2))
    padded = padded_like_a_graph(inputs, num_padded_tokens=5, num_empty_seqs=2)  # sequences num_seqs, key.num_seqs
    tiles = padded_tiles(query_lens, seq_lens, key)
    assert (tiles[0] == key.num_seqs).sum() >= 2  # some no-op tiles
    got = varlen_attention_triton(*padded, tiles, key.block_m, 0.3)
    torch.testing.assert_close(got[:num_tokens], varlen_attention_torch(*inputs, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel runs on CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("query_lens", "seq_lens"), [*MIXES, ([1] * 8 + [128], [300] * 8 + [700])])
def test_kernel_matches_twin_on_cuda(query_lens, seq_lens, dtype) -> None:
    from services.scheduler.model.triton_varlen import varlen_attention_triton

    inputs = ragged_inputs(query_lens, seq_lens, 32, 8, 128, page=16, dtype=dtype, device="cuda")
    block_m = tile_tokens(max(query_lens), 4)
    tiles = torch.tensor(query_tiles(query_lens, seq_lens, block_m), dtype=torch.int32).T.contiguous().cuda()
    got = varlen_attention_triton(*inputs, tiles, block_m, 128**-0.5).float()
    torch.testing.assert_close(got, varlen_attention_torch(*inputs, 128**-0.5).float(), atol=2e-2, rtol=2e-2)
