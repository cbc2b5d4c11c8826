"""Batch invariance (`batch_invariant.py`, `--deterministic`), bitwise: a row's product and a
query's attention are the same bits whatever else shares the call, for the CPU twins and, in
Triton's interpreter, for the fixed-tile matmul and the varlen kernel's invariant mode."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from services.scheduler.model.attention import MAX_TILE_ROWS, query_tiles, tile_tokens, varlen_attention_torch
from services.scheduler.model.batch_invariant import Linear, linear_rowwise, set_batch_invariant, tile_config
from tests.services.scheduler.model.test_varlen_attention import ragged_inputs
from tests.services.scheduler.model.triton_interpreter import INTERPRETED, run_interpreted_cases

GEN = torch.Generator().manual_seed(7)
X = torch.randn(67, 96, generator=GEN)
W = torch.randn(80, 96, generator=GEN)
B = torch.randn(80, generator=GEN)


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
    assert tile_config(4096, 4096, 132) == tile_config(4096, 4096, 132)
    assert tile_config(4096, 4096, 132).block_n == 16 and tile_config(28672, 4096, 132).block_n == 128
    assert tile_config(4096, 96, 132).block_k == 64  # K not a multiple of 128


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
def test_interpreted_varlen_kernel_invariant_mode_is_the_same_for_decode_verify_and_prefill_queries() -> None:
    from services.scheduler.model.triton_varlen import LaunchConfig, varlen_attention_triton

    group = 2  # ragged_inputs' 4 query heads over 2 kv heads
    block_m = tile_tokens(MAX_TILE_ROWS, group)

    def attend(query, key_cache, value_cache, starts, seq_lens, tables):
        query_lens = starts.diff().tolist()
        tiles = torch.tensor(query_tiles(query_lens, seq_lens.tolist(), block_m), dtype=torch.int32).T.contiguous()
        return varlen_attention_triton(query, key_cache, value_cache, starts, seq_lens, tables, tiles, block_m, 0.3,
                                       LaunchConfig(block_n=16), invariant=True)  # fmt: skip

    decode_chunk_and_verify(attend)


@pytest.mark.skipif(INTERPRETED or importlib.util.find_spec("triton") is None, reason="needs Triton (its compiler, not a GPU)")
@pytest.mark.parametrize("has_bias", [False, True])
def test_matmul_kernel_compiles_for_the_h100(has_bias) -> None:
    # The interpreter runs the kernel's Python; the compiler also checks its types and the bf16 dot.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from services.scheduler.model import triton_matmul

    config = tile_config(4096, 4096, 132)
    signature = {**dict.fromkeys(["x_ptr", "w_ptr", "b_ptr", "out_ptr"], "*bf16"),
                 **dict.fromkeys(["M", "N", "K", "stride_xm", "stride_wn", "stride_om"], "i32")}  # fmt: skip
    constants = {"HAS_BIAS": has_bias, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k}
    source = ASTSource(triton_matmul._matmul_kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants)
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


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
