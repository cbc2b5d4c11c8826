"""Batch invariance (`batch_invariant.py`, `--deterministic`), bitwise: a row's product and a
query's attention are the same bits whatever else shares the call, for the CPU twins and, in
Triton's interpreter, for the fixed-tile matmul and the varlen kernel's invariant mode."""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from services.scheduler.model.attention import MAX_TILE_ROWS, query_tiles, tile_tokens, varlen_attention_torch
from services.scheduler.model.batch_invariant import (
    MIN_STEPS_PER_SPLIT, Linear, TileConfig, linear_rowwise, set_batch_invariant, tile_config,
)  # fmt: skip
from tests.services.scheduler.model.test_varlen_attention import ragged_inputs
from tests.services.scheduler.model.triton_interpreter import INTERPRETED, run_interpreted_cases

GEN = torch.Generator().manual_seed(7)
X = torch.randn(67, 96, generator=GEN)
W = torch.randn(80, 96, generator=GEN)
B = torch.randn(80, generator=GEN)
# A weight whose one-row step gets K split 3 ways on a 4-SM card: 37 rows of N make one tile, K = 777 makes
# 13 BLOCK_K steps (5, 5, 3 per split), the last 9 columns wide.
SPLIT_SHAPE, SPLIT_SMS = (37, 777), 4
SPLIT_X = torch.randn(64, SPLIT_SHAPE[1], generator=GEN)
SPLIT_W = torch.randn(*SPLIT_SHAPE, generator=GEN)
SPLIT_B = torch.randn(SPLIT_SHAPE[0], generator=GEN)


def assert_rows_invariant(product) -> None:
    """Each row of a 67-row product equals the row alone and inside two other batches."""
    whole = product(X)
    assert torch.equal(product(X[5:9]), whole[5:9]) and torch.equal(product(X[40:]), whole[40:])
    for i in (0, 6, 33, 66):
        assert torch.equal(product(X[i : i + 1])[0], whole[i]), i
    torch.testing.assert_close(whole, F.linear(X, W, B), atol=1e-4, rtol=1e-4)


def test_rowwise_twin_is_batch_invariant() -> None:
    assert_rows_invariant(lambda x: linear_rowwise(x, W, B))


def test_linear_module_switches_to_the_invariant_product() -> None:
    module = Linear(96, 80)
    with torch.no_grad():
        module.weight.copy_(W), module.bias.copy_(B)
    holder = torch.nn.Sequential(module)
    set_batch_invariant(holder, True)
    assert module.invariant and holder.batch_invariant
    with torch.no_grad():
        assert torch.equal(module(X), linear_rowwise(X, W, B))


def test_one_tile_config_per_weight_shape_whatever_m() -> None:
    # the configuration, K's split count included, is a function of (N, K, SMs): M is not even an argument
    assert list(inspect.signature(tile_config).parameters) == ["n", "k", "num_sms"]
    assert tile_config(4096, 4096, 132) == tile_config(4096, 4096, 132)
    assert tile_config(28672, 4096, 132) == TileConfig(64, 128, 128, 4, 3, splits=1)  # N alone fills the SMs
    assert tile_config(4096, 96, 132).block_k == 64 and tile_config(4096, 96, 132).splits == 1  # K too short to split
    assert tile_config(4096, 512, 132).block_n == 16  # ... so the one-row step's programs come from finer N tiles


def test_k_is_split_where_n_gives_a_one_row_step_too_few_programs() -> None:
    down, o = tile_config(4096, 12288, 132), tile_config(4096, 4096, 132)  # the 8B shape's down and o projections
    assert (down.block_n, down.splits) == (64, 4) and (o.block_n, o.splits) == (64, 4)
    for config, k in ((down, 12288), (o, 4096), (tile_config(*SPLIT_SHAPE, SPLIT_SMS), SPLIT_SHAPE[1])):
        steps = -(-k // config.block_k)
        assert -(-steps // -(-steps // config.splits)) == config.splits  # whole BLOCK_K steps, none idle
        assert steps // config.splits >= MIN_STEPS_PER_SPLIT
    assert tile_config(*SPLIT_SHAPE, SPLIT_SMS).splits == 3


def decode_chunk_and_verify(attend) -> None:
    """A prefill chunk's 13 queries (beside other sequences), each query alone as a decode step and a
    4-query verify block ending at one of them give the same bits."""
    query, key_cache, value_cache, starts, seq_lens, tables = ragged_inputs([1, 13, 5], [9, 40, 20])
    chunk = attend(query, key_cache, value_cache, starts, seq_lens, tables)[1:14]  # [13, Hq, D]
    for i in range(13):
        one = torch.tensor([0, 1], dtype=torch.int32)
        alone = attend(query[1 + i : 2 + i], key_cache, value_cache, one, torch.tensor([27 + i + 1], dtype=torch.int32), tables[1:2])
        assert torch.equal(alone[0], chunk[i]), i
    block = torch.tensor([0, 1, 5], dtype=torch.int32)  # a decode of sequence 0, then 4 verify queries ending at index 8
    got = attend(torch.cat([query[:1], query[6:10]]), key_cache, value_cache, block, torch.tensor([9, 36], dtype=torch.int32), tables[:2])
    assert torch.equal(got[1:], chunk[5:9])


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (6, 0.0), (0, 5.0)])
def test_rowwise_attention_twin_is_the_same_for_decode_verify_and_prefill_queries(window, softcap) -> None:
    def attend(query, key_cache, value_cache, starts, seq_lens, tables):
        return varlen_attention_torch(query, key_cache, value_cache, starts, seq_lens, tables, 0.3, window, softcap, True)

    decode_chunk_and_verify(attend)


def test_kernels_in_the_triton_interpreter() -> None:
    """The interpreted cases below, in a child pytest whose Triton starts in interpreter mode."""
    run_interpreted_cases(__file__, timeout_s=180)


@pytest.mark.skipif(not INTERPRETED, reason="run by test_kernels_in_the_triton_interpreter")
def test_interpreted_matmul_is_batch_invariant() -> None:
    from services.scheduler.model.batch_invariant import matmul_triton

    assert_rows_invariant(lambda x: matmul_triton(x, W, B, num_sms=4))


@pytest.mark.skipif(not INTERPRETED, reason="run by test_kernels_in_the_triton_interpreter")
def test_interpreted_split_k_matmul_rows_are_the_same_bits_alone_and_in_batches_of_3_17_64() -> None:
    from services.scheduler.model.batch_invariant import matmul_triton
    from services.scheduler.model.triton_matmul import launch_matmul

    def product(x):
        return matmul_triton(x, SPLIT_W, SPLIT_B, num_sms=SPLIT_SMS)

    whole = product(SPLIT_X)  # [64, 37]
    for i in (0, 16, 17, 40, 63):
        assert torch.equal(product(SPLIT_X[i : i + 1]), whole[i : i + 1]), i
    for rows in (slice(15, 18), slice(40, 57), slice(0, 17)):
        assert torch.equal(product(SPLIT_X[rows]), whole[rows]), rows
    reference = F.linear(SPLIT_X.double(), SPLIT_W.double(), SPLIT_B.double()).float()
    torch.testing.assert_close(whole, reference, atol=2e-4, rtol=1e-5)
    # the split count shows in the bits (K walked whole rounds these rows otherwise): equal bits above
    # mean every batch took the same count
    config = tile_config(*SPLIT_SHAPE, SPLIT_SMS)
    unsplit = launch_matmul(SPLIT_X, SPLIT_W, SPLIT_B, torch.empty_like(whole), replace(config, splits=1))
    torch.testing.assert_close(unsplit, reference, atol=2e-4, rtol=1e-5)
    assert not torch.equal(unsplit, whole)


@pytest.mark.skipif(not INTERPRETED, reason="run by test_kernels_in_the_triton_interpreter")
def test_interpreted_varlen_kernel_invariant_mode_is_the_same_for_decode_verify_and_prefill_queries() -> None:
    decode_chunk_and_verify(varlen_invariant())


def varlen_invariant(kv_splits: int = 1, window: int = 0, softcap: float = 0.0, block_n: int = 16):
    """The varlen kernel's invariant mode over its own tile map, with `kv_splits` programs per tile along the keys."""
    from services.scheduler.model.triton_varlen import LaunchConfig, varlen_attention_triton

    group = 2  # ragged_inputs' 4 query heads over 2 kv heads
    block_m = tile_tokens(MAX_TILE_ROWS, group)

    def attend(query, key_cache, value_cache, starts, seq_lens, tables):
        query_lens = starts.diff().tolist()
        tiles = torch.tensor(query_tiles(query_lens, seq_lens.tolist(), block_m), dtype=torch.int32).T.contiguous()
        return varlen_attention_triton(query, key_cache, value_cache, starts, seq_lens, tables, tiles, block_m, 0.3,
                                       LaunchConfig(block_n=block_n), window=window, softcap=softcap, invariant=True,
                                       kv_splits=kv_splits)  # fmt: skip

    return attend


# A decode, a prefill chunk that crosses the 512-key split boundary and a verify block, past 2 key splits.
LONG_QUERIES, LONG_KEYS = [1, 40, 5], [700, 530, 300]


@pytest.mark.skipif(not INTERPRETED, reason="run by test_kernels_in_the_triton_interpreter")
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (300, 0.0), (0, 5.0)])
def test_interpreted_invariant_split_kv_is_by_size_whatever_the_batch_and_query_count(window, softcap) -> None:
    """Past KV_SPLIT_TOKENS keys: each chunk query alone as a decode step, with its keys spread over
    3 programs or walked by one, and inside a 4-query verify block, is the chunk's row bit for bit;
    and the rows are attention (float64 reference)."""
    from services.scheduler.model.kv_splits import KV_SPLIT_TOKENS

    assert max(LONG_KEYS) > 2 * KV_SPLIT_TOKENS > min(LONG_KEYS)
    query, key_cache, value_cache, starts, seq_lens, tables = ragged_inputs(LONG_QUERIES, LONG_KEYS, page=16)
    serial, split = varlen_invariant(1, window, softcap), varlen_invariant(3, window, softcap)
    whole = serial(query, key_cache, value_cache, starts, seq_lens, tables)  # [46, Hq, D]
    assert torch.equal(split(query, key_cache, value_cache, starts, seq_lens, tables), whole)
    chunk, one = whole[1:41], torch.tensor([0, 1], dtype=torch.int32)
    for i in (0, 1, 2, 21, 22, 39):  # around the split boundary at position 512 (the chunk starts at 490)
        for attend in (serial, split):
            alone = attend(query[1 + i : 2 + i], key_cache, value_cache, one, torch.tensor([490 + i + 1], dtype=torch.int32), tables[1:2])
            assert torch.equal(alone[0], chunk[i]), i
    block = torch.tensor([0, 4], dtype=torch.int32)  # verify queries 19..22 of the chunk, across the boundary
    got = split(query[20:24], key_cache, value_cache, block, torch.tensor([490 + 23], dtype=torch.int32), tables[1:2])
    assert torch.equal(got, chunk[19:23])
    reference = varlen_attention_torch(query, key_cache, value_cache, starts, seq_lens, tables, 0.3, window, softcap)
    torch.testing.assert_close(whole, reference, atol=2e-5, rtol=2e-5)


def test_invariant_split_count_spreads_only_idle_sms_within_the_partials_bound() -> None:
    from services.scheduler.model.kv_splits import KV_SPLIT_TOKENS, MAX_SPLIT_PARTIALS, invariant_kv_splits

    assert invariant_kv_splits(1, 8, 1, 40 * KV_SPLIT_TOKENS, 132) == 40  # batch 1: one program per split
    assert invariant_kv_splits(1, 8, 1, KV_SPLIT_TOKENS, 132) == 1  # one split: nothing to spread
    assert invariant_kv_splits(64, 8, 64, 40 * KV_SPLIT_TOKENS, 132) == 1  # the tiles fill the SMs
    assert invariant_kv_splits(1, 8, MAX_SPLIT_PARTIALS, 2 * KV_SPLIT_TOKENS, 132) == 1  # partials past the bound
    assert invariant_kv_splits(1, 8, 1, 40 * KV_SPLIT_TOKENS, 0) == 1  # off CUDA, or split-KV off


@pytest.mark.skipif(INTERPRETED or importlib.util.find_spec("triton") is None, reason="needs Triton (its compiler, not a GPU)")
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize(("n", "k"), [(28672, 4096), (4096, 12288)])  # one split (bf16 out); four (fp32 partials)
def test_matmul_kernel_compiles_for_the_h100(has_bias, n, k) -> None:
    # The interpreter runs the kernel's Python; the compiler also checks its types and the bf16 dot.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from services.scheduler.model import triton_matmul

    config = tile_config(n, k, 132)
    signature = {**dict.fromkeys(["x_ptr", "w_ptr", "b_ptr"], "*bf16"), "out_ptr": "*bf16" if config.splits == 1 else "*fp32",
                 **dict.fromkeys(["M", "N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_out_split", "stride_om"], "i32")}  # fmt: skip
    constants = {"HAS_BIAS": has_bias, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k}
    source = ASTSource(triton_matmul._matmul_kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants)
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


@pytest.mark.skipif(INTERPRETED or importlib.util.find_spec("triton") is None, reason="needs Triton (its compiler, not a GPU)")
@pytest.mark.parametrize("window", [0, 4096])
def test_split_and_merge_kernels_compile_for_the_h100(window) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from services.scheduler.model import triton_varlen

    lengths = {**dict.fromkeys(["query_start_ptr", "seq_lens_ptr", "tables_ptr", "tiles_ptr"], "*i32"),
               **dict.fromkeys(["num_tiles", "num_heads", "num_splits"], "i32")}  # fmt: skip
    partials = dict.fromkeys(["max_ptr", "sum_ptr", "acc_ptr"], "*fp32")
    rows = {"GROUP": 4, "BLOCK_M": 32, "ROWS": 128, "HEAD_DIM": 128, "WINDOW": window, "KV_SPLIT": 256}
    split = {**dict.fromkeys(["q_ptr", "k_ptr", "v_ptr"], "*bf16"), **partials, **lengths, "qk_scale": "fp32",
             **dict.fromkeys(["stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_tb"], "i32")}  # fmt: skip
    split_constants = {**rows, "PAGE_SIZE": 16, "BLOCK_N": 64, "SOFTCAP2": 0.0}
    merge = {**partials, "out_ptr": "*bf16", **{k: v for k, v in lengths.items() if k != "tables_ptr"},
             "stride_ot": "i32", "stride_oh": "i32"}  # fmt: skip
    for kernel, signature, constants in ((triton_varlen._varlen_split_kernel, split, split_constants),
                                         (triton_varlen._varlen_merge_kernel, merge, rows)):  # fmt: skip
        source = ASTSource(kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants)
        assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["cubin"]


@pytest.mark.skipif(not INTERPRETED, reason="run by test_kernels_in_the_triton_interpreter")
def test_interpreted_runner_on_the_kernels_answers_a_request_alike_alone_and_beside_others() -> None:
    """The mode's routing as CUDA runs it, the kernels interpreted: fused norms/RoPE/K-V write, every
    step on the varlen kernel's invariant plan, through the padded ragged-graph path too."""
    from services.models import RANDOM_TINY_MODEL
    from services.scheduler.build import core_for
    from services.scheduler.model.loader import load_model_runner
    from tests.services.scheduler.test_scheduler_core import prompt_of, request, run
    from contracts.scheduler import LogprobParams

    runner = load_model_runner(RANDOM_TINY_MODEL, device="cpu", num_kv_blocks=64, kv_block_size=16, fused_kernels=True,
                               batch_invariant=True)  # fmt: skip
    runner.ragged_kernel = True
    runner.prepare_ragged_graphs((1, 2), (4, 16), capture=False)
    torch.set_num_threads(1)  # a child process of its own: many small calls, and a second thread only waits
    asks = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    reqs = [request(f"k{i}", prompt_of(70 + i, 5 + 6 * i), max_new_tokens=2, ignore_eos=True, logprobs=asks) for i in range(2)]
    alone = {r.rid: run(core_for(runner, chunked_prefill_size=64), [r])[r.rid] for r in reqs}
    together = run(core_for(runner, chunked_prefill_size=4), reqs)  # chunks beside decodes
    for rid, a in alone.items():
        b = together[rid]
        assert a.tokens == b.tokens, rid
        for name in ("input_token", "input_top_values", "output_token", "output_top_values"):
            assert a.cat(name).tobytes() == b.cat(name).tobytes(), (rid, name)


@pytest.mark.skipif(not INTERPRETED, reason="run by test_kernels_in_the_triton_interpreter")
def test_interpreted_gemma2_rows_are_bitwise_alone_and_beside_others_on_the_row_norms(saved_family, monkeypatch) -> None:
    """Tiny Gemma 2 (sandwich (1 + w) norms, sliding windows, soft-capping) in the mode as CUDA runs
    it, the kernels interpreted: every norm on the row kernel (`llama.norm_rows`), and a request's
    ids and logprobs the same bits alone and in 4-token chunks beside another's decodes."""
    from contracts.scheduler import LogprobParams
    from services.scheduler.build import core_for
    from services.scheduler.model import gemma, llama
    from services.scheduler.model.loader import load_model_runner
    from tests.services.scheduler.model.test_families_core import prompt
    from tests.services.scheduler.test_scheduler_core import request, run

    routed = []
    monkeypatch.setattr(gemma, "norm_rows", lambda x, norm: routed.append(norm) or llama.norm_rows(x, norm))
    _, path = saved_family("gemma2")
    runner = load_model_runner(path, device="cpu", num_kv_blocks=64, kv_block_size=16, fused_kernels=True, batch_invariant=True)
    set_batch_invariant(runner.model, True, row_kernels=True)  # what CUDA gets by default
    runner.ragged_kernel = True
    torch.set_num_threads(1)
    asks = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    reqs = [request(f"g{i}", prompt(9 + 8 * i, seed=i), max_new_tokens=3, ignore_eos=True, logprobs=asks) for i in range(2)]
    alone = {r.rid: run(core_for(runner, chunked_prefill_size=64), [r])[r.rid] for r in reqs}
    together = run(core_for(runner, chunked_prefill_size=4), reqs)
    assert {type(norm) for norm in routed} == {gemma.GemmaRMSNorm}
    for rid, a in alone.items():
        assert len(a.tokens) == 3 and a.tokens == together[rid].tokens, rid
        for name in ("input_token", "input_top_values", "output_token", "output_top_values"):
            assert a.cat(name).tobytes() == together[rid].cat(name).tobytes(), (rid, name)
