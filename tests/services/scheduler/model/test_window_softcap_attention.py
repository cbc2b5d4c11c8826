"""Sliding windows and attention soft-capping on every attention path: the torch twins against a
float64 reference written from the definition, the ragged SDPA groups against the twin, and the
Triton decode and varlen kernels in Triton's CPU interpreter (and down to an sm_90 cubin)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from services.scheduler.model.attention import (
    DecodePlan,
    paged_attention,
    paged_decode_attention_torch,
    plan_attention,
    plan_varlen,
    query_tiles,
    tile_tokens,
    varlen_attention_torch,
)
from tests.services.scheduler.model.test_split_kv_decode import decode_inputs
from tests.services.scheduler.model.test_varlen_attention import MIXES, padded_like_a_graph, ragged_inputs
from tests.services.scheduler.model.triton_interpreter import INTERPRETED, interpreted, run_interpreted_cases, runs_the_interpreter

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
SCALE = 1.0  # scores of std ~4 on these random inputs: a cap of 3 bends most of them
# (window, softcap): each alone, both, and a window wider than every sequence here (no effect)
FEATURES = [(5, 0.0), (0, 3.0), (3, 3.0), (1, 0.0), (200, 0.0)]


def reference(query, key_cache, value_cache, starts, seq_lens, tables, scale, window, softcap):
    """Per sequence and query: its visible keys (the causal window) gathered, float64, from the definition."""
    outs = []
    page = key_cache.shape[1]
    for b, seq_len in enumerate(seq_lens.tolist()):
        blocks = tables[b, : -(-seq_len // page)].long()
        k, v = (c[blocks].flatten(0, 1)[:seq_len].double() for c in (key_cache, value_cache))  # [L, Hkv, D]
        q_len = int(starts[b + 1] - starts[b])
        for i in range(q_len):
            pos = seq_len - q_len + i
            first = max(0, pos - window + 1) if window else 0
            q = query[starts[b] + i].double()  # [Hq, D]
            group = q.shape[0] // k.shape[1]
            keys, values = (x[first : pos + 1].repeat_interleave(group, 1) for x in (k, v))  # [n, Hq, D]
            scores = torch.einsum("hd,nhd->hn", q, keys) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
    return torch.stack(outs)  # [T, Hq, D]


def as_varlen(decode_args, query_len: int):
    """decode_inputs' tensors as the varlen twin's: query_start_loc of query_len tokens each."""
    query, key_cache, value_cache, lens, tables = decode_args
    starts = torch.arange(0, (len(lens) + 1) * query_len, query_len, dtype=torch.int32)
    return query, key_cache, value_cache, starts, lens, tables


@pytest.mark.parametrize(("window", "softcap"), FEATURES)
@pytest.mark.parametrize(("query_lens", "seq_lens"), MIXES)
def test_varlen_twin_matches_the_definition(query_lens, seq_lens, window, softcap) -> None:
    inputs = ragged_inputs(query_lens, seq_lens, num_heads=4, num_kv_heads=2)
    got = varlen_attention_torch(*inputs, SCALE, window, softcap)
    torch.testing.assert_close(got.double(), reference(*inputs, SCALE, window, softcap), **TOLERANCE)


@pytest.mark.parametrize(("window", "softcap"), FEATURES)
@pytest.mark.parametrize("query_len", [1, 4])
def test_decode_twin_matches_the_definition(query_len, window, softcap) -> None:
    args = decode_inputs([5, 23, 45], query_len, num_padded=0)
    got = paged_decode_attention_torch(*args, SCALE, query_len, window, softcap)
    torch.testing.assert_close(got.double(), reference(*as_varlen(args, query_len), SCALE, window, softcap), **TOLERANCE)


def test_the_features_change_the_output() -> None:
    # What the cases above compare would pass with a feature ignored if it changed nothing here.
    inputs = ragged_inputs(*MIXES[0])
    plain = varlen_attention_torch(*inputs, SCALE)
    for window, softcap in FEATURES[:4]:
        assert (varlen_attention_torch(*inputs, SCALE, window, softcap) - plain).abs().max() > 0.1, (window, softcap)


@pytest.mark.parametrize(("window", "softcap"), FEATURES)
def test_sdpa_groups_match_the_twin(make_pager, window, softcap) -> None:
    # The CPU ragged path: a prefill chunk with context, two whole prompts of one length (the plain
    # causal group), a decode and a verify block, in one step.
    pager = make_pager(num_seqs=5, max_blocks_per_seq=12, block_size=4)
    chunks = [(0, list(range(20)), 20), (1, list(range(9)), 0), (2, list(range(9)), 0), (3, [5], 12), (4, [6, 7, 8, 9], 10)]
    batch = pager.batch(chunks)
    gen = torch.Generator().manual_seed(4)
    num_blocks = pager.num_blocks + 1
    caches = [torch.randn(num_blocks, 4, 2, 16, generator=gen) for _ in range(2)]
    query = torch.randn(batch.num_tokens, 4, 16, generator=gen)
    groups = paged_attention(query, *caches, plan_attention(batch, 4), SCALE, window, softcap)
    twin = paged_attention(query, *caches, plan_varlen(batch, 2, use_kernel=False), SCALE, window, softcap)
    torch.testing.assert_close(groups, twin, **TOLERANCE)


@runs_the_interpreter
def test_window_and_softcap_kernels_in_the_triton_interpreter() -> None:
    """The interpreted cases below, in a child pytest whose Triton starts in interpreter mode."""
    run_interpreted_cases(__file__)


@interpreted
@pytest.mark.parametrize(("window", "softcap"), FEATURES[:4])
@pytest.mark.parametrize(("query_len", "num_splits"), [(1, 1), (1, 3), (4, 1), (4, 3)])
def test_interpreted_decode_kernel_matches_twin(query_len, num_splits, window, softcap) -> None:
    from services.scheduler.model.triton_decode import paged_block_attention_triton

    args = (*decode_inputs([4, 6, 23, 45], query_len, num_padded=2), SCALE, query_len)  # graph-padded rows too
    got = paged_block_attention_triton(*args, num_splits, window=window, softcap=softcap)
    torch.testing.assert_close(got, paged_decode_attention_torch(*args, window, softcap), **TOLERANCE)


@interpreted
@pytest.mark.parametrize(("window", "softcap"), FEATURES[:4])
@pytest.mark.parametrize("block_n", [16, 64])
@pytest.mark.parametrize(("query_lens", "seq_lens"), MIXES)
def test_interpreted_varlen_kernel_matches_twin(query_lens, seq_lens, block_n, window, softcap) -> None:
    from services.scheduler.model.triton_varlen import LaunchConfig, varlen_attention_triton

    inputs = ragged_inputs(query_lens, seq_lens, num_heads=4, num_kv_heads=2)
    block_m = tile_tokens(max(query_lens), 2)
    tiles = torch.tensor(query_tiles(query_lens, seq_lens, block_m), dtype=torch.int32).T.contiguous()
    got = varlen_attention_triton(*inputs, tiles, block_m, SCALE, LaunchConfig(block_n=block_n), window=window, softcap=softcap)
    torch.testing.assert_close(got, varlen_attention_torch(*inputs, SCALE, window, softcap), **TOLERANCE)


@interpreted
def test_interpreted_varlen_kernel_on_a_padded_step_with_a_window() -> None:
    from services.scheduler.model.ragged_graphs import RaggedKey, padded_tiles
    from services.scheduler.model.triton_varlen import varlen_attention_triton

    query_lens, seq_lens = MIXES[0]
    inputs = ragged_inputs(query_lens, seq_lens)
    key = RaggedKey(num_seqs=len(query_lens) + 1, num_tokens=sum(query_lens) + 5, block_m=tile_tokens(max(query_lens), 2))
    padded = padded_like_a_graph(inputs, num_padded_tokens=5, num_empty_seqs=2)
    got = varlen_attention_triton(*padded, padded_tiles(query_lens, seq_lens, key), key.block_m, SCALE, window=5, softcap=3.0)
    want = varlen_attention_torch(*inputs, SCALE, 5, 3.0)
    torch.testing.assert_close(got[: sum(query_lens)], want, **TOLERANCE)


@pytest.mark.skipif(INTERPRETED or importlib.util.find_spec("triton") is None, reason="needs Triton (its compiler, not a GPU)")
@pytest.mark.parametrize(("window", "softcap", "kv_split"), [(0, 0.0, 0), (4096, 50.0, 0), (0, 0.0, 256), (4096, 50.0, 256)])
def test_varlen_kernel_compiles_for_the_h200(window, softcap, kv_split) -> None:
    # The interpreter runs the kernel's Python; the compiler also checks types across its branches.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from services.scheduler.model import triton_varlen

    names = ["q_ptr", "k_ptr", "v_ptr", "out_ptr"]
    signature = {**dict.fromkeys(names, "*bf16"), **dict.fromkeys(["query_start_ptr", "seq_lens_ptr", "tables_ptr", "tiles_ptr"], "*i32")}
    strides = ["stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_ot", "stride_oh", "stride_tb"]
    signature |= {"num_tiles": "i32", "qk_scale": "fp32", **dict.fromkeys(strides, "i32")}
    constants = {"GROUP": 4, "BLOCK_M": 32, "ROWS": 128, "HEAD_DIM": 128, "PAGE_SIZE": 16, "BLOCK_N": 64,
                 "WINDOW": window, "SOFTCAP2": softcap * triton_varlen.LOG2_E, "KV_SPLIT": kv_split}  # fmt: skip
    source = ASTSource(triton_varlen._varlen_kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants)
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


def test_decode_plan_passes_window_and_softcap_to_the_twin() -> None:
    args = decode_inputs([23, 45], 1, num_padded=0)
    query, key_cache, value_cache, lens, tables = args
    plan = DecodePlan(lens, tables, use_kernel=False)
    got = paged_attention(query, key_cache, value_cache, plan, SCALE, 5, 3.0)
    torch.testing.assert_close(got, paged_decode_attention_torch(*args, SCALE, 1, 5, 3.0), atol=0, rtol=0)


@pytest.mark.parametrize(("family", "dense"), [("llama", True), ("mistral", False), ("gemma2", False)])
def test_models_with_windows_or_soft_caps_keep_long_queries_off_the_dense_path(saved_family, family, dense) -> None:
    from services.scheduler.model.dense_attention import DenseConfig
    from services.scheduler.model.loader import load_model_runner

    runner = load_model_runner(saved_family(family)[1], num_kv_blocks=8, kv_block_size=16)
    runner.dense_prefill = DenseConfig()
    assert (runner.dense_prefill is not None) is dense


def test_a_dense_plan_refuses_a_window() -> None:
    from services.scheduler.model.attention import VarlenPlan, varlen_attention
    from services.scheduler.model.dense_attention import DenseConfig, plan_dense

    query, key_cache, value_cache, starts, seq_lens, tables = ragged_inputs([20], [20])
    dense = plan_dense(starts.tolist(), seq_lens.tolist(), DenseConfig(min_query_len=8))
    plan = VarlenPlan(starts, seq_lens, tables, torch.zeros(2, 0, dtype=torch.int32), 32, False, dense)
    with pytest.raises(ValueError, match="dense path"):
        varlen_attention(query, key_cache, value_cache, plan, SCALE, window=5)
