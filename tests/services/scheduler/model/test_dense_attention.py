"""The dense path for a ragged step's long queries (`dense_attention.py`): the plan that takes them
out of the varlen tile map, their attention over gathered K/V against the varlen twin (context 0
and later chunks, both masks, GQA), the log-sum-exp merge against one softmax, and the Triton
kernel + dense path together in Triton's CPU interpreter (skipped without Triton)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.scheduler.model.attention import plan_varlen, query_tiles, tile_tokens, varlen_attention, varlen_attention_torch
from services.scheduler.model.dense_attention import (
    DENSE_MASKS,
    DenseConfig,
    attend_dense,
    attention_with_lse_torch,
    merge_by_lse,
    plan_dense,
    resolve_dense_kernel,
)
from services.scheduler.model.flash4_attention import flash4_unavailable
from tests.services.scheduler.model.test_varlen_attention import ragged_inputs
from tests.services.scheduler.model.triton_interpreter import interpreted, run_interpreted_cases, runs_the_interpreter

SCALE = 0.3
# (query lengths, seq lens) with min_query_len 32: decodes, one long chunk, one short chunk
STEPS = [
    ([40], [40]),  # a whole prompt: context 0
    ([48], [100]),  # a later chunk
    ([32], [33]),  # context 1, the query just long enough
    ([1, 64, 7, 1, 40], [50, 64, 30, 9, 200]),  # decodes + a first chunk + a short chunk + a late chunk
]


def ragged_batch(query_lens, seq_lens, tables, device="cpu"):
    """A ForwardBatch carrying what the planners read (lengths and tables)."""
    from services.scheduler.model.batch import ForwardBatch

    num_tokens = sum(query_lens)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    zeros = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    return ForwardBatch(zeros, zeros, starts.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                        tables.to(device), zeros, host_query_lens=tuple(query_lens), host_seq_lens=tuple(seq_lens))  # fmt: skip


def test_plan_takes_long_queries_out_of_the_tile_map() -> None:
    query_lens, seq_lens = [1, 64, 7, 1, 40], [50, 64, 30, 9, 200]
    batch = ragged_batch(query_lens, seq_lens, torch.zeros(5, 60, dtype=torch.int32))
    plan = plan_varlen(batch, group=4, dense=DenseConfig(min_query_len=32))
    assert [(s.seq, s.token_start, s.query_len, s.seq_len) for s in plan.dense.sequences] == [(1, 1, 64, 64), (4, 73, 40, 200)]
    short = [1, 0, 7, 1, 0]
    assert plan.block_m == tile_tokens(7, 4)
    assert plan.tiles.T.tolist() == [list(t) for t in query_tiles(short, seq_lens, plan.block_m)]
    assert sorted(set(plan.tiles[0].tolist())) == [0, 2, 3]
    assert plan_varlen(batch, group=4).dense is None
    assert plan_varlen(batch, group=4, dense=DenseConfig(min_query_len=100)).dense is None
    assert plan.dense.whole_step(sum(query_lens)) is None  # decodes beside: the rows are written into the step's output
    alone = plan_varlen(ragged_batch([48], [100], torch.zeros(1, 60, dtype=torch.int32)), group=4, dense=DenseConfig(min_query_len=32))
    assert alone.dense.whole_step(48) == alone.dense.sequences[0]  # a prompt alone: its dense output is the step's


def test_config_rejects_unknown_masks_and_empty_thresholds() -> None:
    with pytest.raises(ValueError, match="mask"):
        DenseConfig(mask="upper_left")
    with pytest.raises(ValueError, match="min_query_len"):
        DenseConfig(min_query_len=0)
    with pytest.raises(ValueError, match="lse_backends"):
        DenseConfig(lse_backends=("efficient",))
    with pytest.raises(ValueError, match="kernel"):
        DenseConfig(kernel="cudnn")


def test_dense_kernel_falls_back_to_sdpa_where_flash4_cannot_run_and_says_why_when_asked_for() -> None:
    cpu = torch.device("cpu")
    assert resolve_dense_kernel("auto", cpu) == "sdpa"
    assert resolve_dense_kernel("sdpa", cpu) == "sdpa"
    assert flash4_unavailable(cpu) == "flash4 needs CUDA, not cpu"
    with pytest.raises(ValueError, match="flash4 needs CUDA"):
        resolve_dense_kernel("flash4", cpu)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_dense_kernel("cudnn", cpu)


def test_flash4_not_installed_is_said_before_the_gpu_is_asked_anything(monkeypatch) -> None:
    """A CUDA device named on a machine without the package (CI's, with a CPU torch) gets the
    reason without a CUDA call: auto then takes sdpa, and build_core starts."""
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: pytest.fail("asked the GPU"))
    cuda = torch.device("cuda")
    assert flash4_unavailable(cuda) == "flash4 is not installed (pip install -e '.[flash4]')"
    assert resolve_dense_kernel("auto", cuda) == "sdpa"


def dense_rows(query_lens, min_query_len=32):
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    return [t for b, n in enumerate(query_lens) if n >= min_query_len for t in range(starts[b], starts[b + 1])]


@pytest.mark.parametrize("expand_kv", [False, True])
@pytest.mark.parametrize("mask", DENSE_MASKS)
@pytest.mark.parametrize(("query_lens", "seq_lens"), STEPS)
def test_dense_rows_match_the_varlen_twin(query_lens, seq_lens, mask, expand_kv) -> None:
    inputs = ragged_inputs(query_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=16, page=4)  # GQA 4:1
    query, key_cache, value_cache, starts, lens, tables = inputs
    config = DenseConfig(min_query_len=32, mask=mask, expand_kv=expand_kv)
    out = torch.full_like(query, float("nan"))
    attend_dense(query, key_cache, value_cache, tables, plan_dense(starts.tolist(), seq_lens, config), SCALE, out)
    rows = dense_rows(query_lens)
    torch.testing.assert_close(out[rows], varlen_attention_torch(*inputs, SCALE)[rows], atol=1e-5, rtol=1e-5)
    others = [t for t in range(query.shape[0]) if t not in rows]
    assert out[others].isnan().all()  # only the dense rows are written


@pytest.mark.parametrize("first", [0, 16, 64, 112])
def test_chunks_of_one_prompt_at_several_positions(first) -> None:
    # Chunk first..first+48 of a 160-token prompt (the earlier chunks' K/V already cached).
    query_lens, seq_lens = [48], [first + 48]
    inputs = ragged_inputs(query_lens, seq_lens, num_heads=8, num_kv_heads=2, page=4)
    batch = ragged_batch(query_lens, seq_lens, inputs[5])
    for mask in DENSE_MASKS:
        plan = plan_varlen(batch, group=4, use_kernel=False, dense=DenseConfig(min_query_len=32, mask=mask))
        got = varlen_attention(inputs[0], inputs[1], inputs[2], plan, SCALE)
        torch.testing.assert_close(got, varlen_attention_torch(*inputs, SCALE), atol=1e-5, rtol=1e-5)


def test_mixed_step_through_varlen_attention_matches_the_twin() -> None:
    query_lens, seq_lens = STEPS[-1]
    inputs = ragged_inputs(query_lens, seq_lens, num_heads=8, num_kv_heads=2, page=4)
    plan = plan_varlen(ragged_batch(query_lens, seq_lens, inputs[5]), group=4, use_kernel=False, dense=DenseConfig(32))
    assert len(plan.dense.sequences) == 2
    got = varlen_attention(inputs[0], inputs[1], inputs[2], plan, SCALE)
    torch.testing.assert_close(got, varlen_attention_torch(*inputs, SCALE), atol=1e-5, rtol=1e-5)


def masked_softmax_attention(q, k, v, seen):
    """One softmax over the keys `seen` [q, L] marks: q [B, H, q, D], k, v [B, H, L, D]."""
    scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~seen, float("-inf"))
    return scores.softmax(-1) @ v


def two_halves(context=24, q_len=10, heads=3, dim=8):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, heads, q_len, dim, generator=gen)
    k, v = (torch.randn(1, heads, context + q_len, dim, generator=gen) for _ in range(2))
    seen = torch.arange(context + q_len)[None, :] <= torch.arange(context, context + q_len)[:, None]  # lower-right
    o_a, lse_a = attention_with_lse_torch(q, k[:, :, :context], v[:, :, :context], SCALE, causal=False)
    o_b, lse_b = attention_with_lse_torch(q, k[:, :, context:], v[:, :, context:], SCALE, causal=True)
    return (o_a, lse_a, o_b, lse_b), masked_softmax_attention(q, k, v, seen)


def test_lse_merge_equals_one_masked_softmax() -> None:
    halves, expected = two_halves()
    torch.testing.assert_close(merge_by_lse(*halves), expected, atol=1e-6, rtol=1e-6)


def test_a_wrong_merge_is_caught() -> None:
    (o_a, lse_a, o_b, lse_b), expected = two_halves()
    averaged = (o_a + o_b) / 2  # no LSE weights
    swapped = merge_by_lse(o_a, lse_b, o_b, lse_a)  # weights on the wrong halves
    base2 = merge_by_lse(o_a, lse_a / torch.log(torch.tensor(2.0)), o_b, lse_b / torch.log(torch.tensor(2.0)))
    for wrong in (averaged, swapped, base2):
        assert (wrong - expected).abs().max() > 1e-3


def test_lse_twin_matches_logsumexp_of_the_scores() -> None:
    gen = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(1, 4, 6, 8, generator=gen), torch.randn(1, 2, 6, 8, generator=gen), torch.randn(1, 2, 6, 8, generator=gen)
    out, lse = attention_with_lse_torch(q, k, v, SCALE, causal=True)
    k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ k4.transpose(-1, -2) * SCALE).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    torch.testing.assert_close(out, scores.softmax(-1) @ v4)


@runs_the_interpreter
def test_kernel_and_dense_path_in_the_triton_interpreter() -> None:
    run_interpreted_cases(__file__)


@interpreted
@pytest.mark.parametrize("mask", DENSE_MASKS)
def test_interpreted_kernel_leaves_dense_rows_to_the_dense_path(mask) -> None:
    # The kernel's output starts uninitialised and it stores only tiled rows: the dense sequences'
    # rows are right only if the dense path writes them.
    query_lens, seq_lens = STEPS[-1]
    inputs = ragged_inputs(query_lens, seq_lens, num_heads=8, num_kv_heads=2, page=4)
    batch = ragged_batch(query_lens, seq_lens, inputs[5])
    plan = plan_varlen(batch, group=4, use_kernel=True, dense=DenseConfig(min_query_len=32, mask=mask))
    got = varlen_attention(inputs[0], inputs[1], inputs[2], plan, SCALE)
    torch.testing.assert_close(got, varlen_attention_torch(*inputs, SCALE), atol=1e-5, rtol=1e-5)
    no_dense = dataclasses.replace(plan, dense=None)
    assert not torch.allclose(varlen_attention(inputs[0], inputs[1], inputs[2], no_dense, SCALE)[dense_rows(query_lens)],
                              got[dense_rows(query_lens)])  # fmt: skip


def test_runner_sends_dense_steps_around_the_ragged_graphs_and_matches_the_sdpa_groups(make_pager, monkeypatch) -> None:
    from services.scheduler.model import runner as runner_module
    from tests.services.scheduler.model.test_varlen_attention import prefilled_runner

    runner, mixed = prefilled_runner(make_pager)  # a 20-token chunk with context, a decode, a verify block
    mixed = dataclasses.replace(mixed, host_query_lens=(20, 1, 4), host_seq_lens=(40, 13, 14))
    kv = runner.kv_cache.kv.clone()
    expected = runner.forward(mixed).hidden_states  # the SDPA groups (CPU default)
    plans = []

    def twin_plan(batch, group, **options):
        plans.append(plan_varlen(batch, group, **{**options, "use_kernel": False}))
        return plans[-1]

    monkeypatch.setattr(runner_module, "plan_varlen", twin_plan)
    runner.ragged_kernel = True
    runner.prepare_ragged_graphs(capture=False)
    runner.dense_prefill = DenseConfig(min_query_len=16)
    replayed = []
    monkeypatch.setattr(runner.ragged_graphs, "run", lambda batch: replayed.append(batch))
    runner.kv_cache.kv.copy_(kv)
    got = runner.forward(mixed).hidden_states
    assert not replayed and [s.seq for s in plans[-1].dense.sequences] == [0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    runner.dense_prefill = DenseConfig(min_query_len=21)  # no query that long: the graphs take the step
    runner.forward(mixed)
    assert len(replayed) == 1
