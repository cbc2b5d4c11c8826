"""The fused MoE kernel (triton_moe.py) against its torch twin (`moe.experts_reference`), fp32, in
Triton's CPU interpreter: uneven expert loads, an expert that gets no token, one that gets every
token, decode-sized and prefill-sized steps; the block alignment's capacity and padding checked alone."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.model.moe import experts_reference, route
from tests.services.scheduler.model.triton_interpreter import (
    compile_for_hopper, compiles, interpreted, run_interpreted_cases, runs_the_interpreter,
)

E, H, I = 6, 40, 24  # noqa: E741  (not multiples of the tiles: masked edges)


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return 0.3 * torch.randn(E, 2 * I, H, generator=gen), 0.3 * torch.randn(E, H, I, generator=gen)


def uneven_routing(num_tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router ids where expert 0 is every token's first choice, expert E-1 nobody's, the rest random."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, E, generator=gen)
    logits[:, 0] += 10.0
    logits[:, E - 1] -= 10.0
    return route(logits, top_k, renormalize=True)


@runs_the_interpreter
def test_triton_moe_in_the_interpreter() -> None:
    run_interpreted_cases(__file__)


@interpreted
@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m"), [(1, 2, 6, 16), (37, 2, 6, 4), (70, 3, 5, 16)])
def test_align_kernel_equals_its_torch_twin_interpreted(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> None:
    # 70 x 3 pairs: more than one chunk of the kernel's; 5 experts: not a power of two
    from services.scheduler.model.triton_moe import align_to_blocks, align_to_blocks_torch

    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), generator=gen)  # the last expert: none
    for got, want in zip(align_to_blocks(ids, num_experts, block_m), align_to_blocks_torch(ids, num_experts, block_m)):
        assert torch.equal(got, want)


@interpreted
@pytest.mark.parametrize("num_tokens", [1, 3, 37])
def test_fused_experts_match_the_twin_interpreted(num_tokens: int) -> None:
    from services.scheduler.model.triton_moe import fused_experts

    gate_up, down = weights()
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(num_tokens))
    routing = uneven_routing(num_tokens, 2, seed=num_tokens)
    counts = torch.bincount(routing[1].flatten(), minlength=E)
    assert counts[E - 1] == 0 and counts[0] == num_tokens
    torch.testing.assert_close(fused_experts(x, gate_up, down, *routing), experts_reference(x, gate_up, down, *routing),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_blocks_hold_each_experts_pairs_padded() -> None:
    from services.scheduler.model.triton_moe import align_to_blocks_torch, capacity

    ids = torch.tensor([[0, 2], [2, 0], [2, 1], [0, 2], [2, 3]])  # experts 4, 5 get no pair
    pairs, experts = align_to_blocks_torch(ids, num_experts=6, block_m=4)
    assert pairs.numel() == capacity(10, 6, 4) == 28  # 10 pairs + at most min(6, 10) experts' pads of 3
    blocks = pairs.view(-1, 4)
    flat = ids.flatten()
    for block, expert in zip(blocks.tolist(), experts.tolist()):
        real = [p for p in block if p < 10]
        assert all(int(flat[p]) == expert for p in real)  # a block is one expert's
    assert sorted(p for p in pairs.tolist() if p < 10) == list(range(10))  # every pair once
    assert experts.tolist() == [0, 1, 2, 2, 3, 6, 6]  # expert 2's 5 pairs take 2 blocks; spare blocks: E (skipped)


@interpreted
def test_interpreted_moe_model_forward_fused_equals_the_twin(make_pager) -> None:
    # A Qwen3-MoE forward (layer 1 dense) with the fused kernels on against off: a prefill through the
    # padded ragged-graph twin, then a decode through the padded decode-graph twin, whose padded rows
    # route through the kernel too.
    import dataclasses

    from services.scheduler.model.config import ModelConfig
    from services.scheduler.model.kv_cache import PagedKVCache
    from services.scheduler.model.runner import ModelRunner
    from tests.services.scheduler.model.test_fused_kernels import random_model

    config = ModelConfig.from_dict({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 96, "hidden_size": 48,
                                    "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "head_dim": 16, "num_experts": E, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": I, "norm_topk_prob": True, "mlp_only_layers": [1],
                                    "max_position_embeddings": 128})  # fmt: skip
    pager = make_pager(num_seqs=3, max_blocks_per_seq=4, block_size=4, seed=1)
    cache = lambda: PagedKVCache(config, pager.num_blocks, 4, torch.float32, torch.device("cpu"))  # noqa: E731
    runners = [ModelRunner(random_model(config), cache()) for _ in range(2)]
    runners[1].fused_kernels = True
    prefill = pager.batch([(0, [5, 6, 7, 8, 9], 0), (1, [10, 11, 12], 0)])
    prefill = dataclasses.replace(prefill, host_query_lens=(5, 3), host_seq_lens=(5, 3))
    decode = pager.batch([(0, [40], 5), (1, [41], 3)])
    outputs = []
    for runner in runners:
        runner.prepare_ragged_graphs((4,), (12,), max_blocks_per_seq=4, capture=False)
        runner.prepare_decode_graphs(ladder=(4,), max_blocks_per_seq=4, capture=False)
        outputs.append((runner.forward(prefill).hidden_states, runner.forward(decode).hidden_states))
    for got, want in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@compiles
def test_moe_kernels_compile_for_hopper_at_the_30b_a3b_shape() -> None:
    from services.scheduler.model import triton_moe

    i32, i64 = "i32", "*i64"
    gemm = {"a_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "out_ptr": "*bf16", "pairs_ptr": i64, "block_experts_ptr": i64,
            "num_pairs": i32, "N": i32, "K": i32, "stride_a": i32, "stride_we": i32, "stride_wn": i32, "stride_se": i32,
            "stride_sn": i32, "stride_sk": i32, "stride_out": i32}  # fmt: skip
    align = {"ids_ptr": i64, "sorted_ptr": i64, "block_experts_ptr": i64, "num_pairs": i32, "rows": i32, "num_blocks": i32}
    fp8 = {**gemm, "w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    # gate/up at decode, down at prefill; FP8 block-wise (128 x 128) and per-row stacks
    for signature, div, block_m, scaled, group in ((gemm, 8, 16, False, (1, 64)), (gemm, 1, 64, False, (1, 64)),
                                                   (fp8, 8, 16, True, (128, 128)), (fp8, 1, 64, True, (1, 64))):  # fmt: skip
        constants = {"ROWS_PER_PAIR_DIV": div, "NUM_EXPERTS": 128, "IEEE": False, "SCALED": scaled, "GROUP_N": group[0],
                     "GROUP_K": group[1], "BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 64}  # fmt: skip
        assert compile_for_hopper(triton_moe._grouped_gemm_kernel, signature, constants)
    assert compile_for_hopper(triton_moe._align_kernel, align, {"NUM_EXPERTS": 128, "EXPERTS_POW2": 128, "BLOCK_M": 16, "CHUNK": 32})
