"""The fused MoE kernel (triton_moe.py) against its torch twin (`moe.experts_reference`), fp32, in
Triton's CPU interpreter: uneven expert loads, an expert that gets no token, one that gets every
token, decode-sized and prefill-sized steps; the block alignment's capacity and padding checked alone."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.model.moe import experts_reference, route
from tests.services.scheduler.model.triton_interpreter import interpreted, run_interpreted_cases, runs_the_interpreter

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
    from services.scheduler.model.triton_moe import align_to_blocks, capacity

    ids = torch.tensor([[0, 2], [2, 0], [2, 1], [0, 2], [2, 3]])  # experts 4, 5 get no pair
    pairs, experts = align_to_blocks(ids, num_experts=6, block_m=4)
    assert pairs.numel() == capacity(10, 6, 4) == 28  # 10 pairs + at most min(6, 10) experts' pads of 3
    blocks = pairs.view(-1, 4)
    flat = ids.flatten()
    for block, expert in zip(blocks.tolist(), experts.tolist()):
        real = [p for p in block if p < 10]
        assert all(int(flat[p]) == expert for p in real)  # a block is one expert's
    assert sorted(p for p in pairs.tolist() if p < 10) == list(range(10))  # every pair once
    assert experts.tolist() == [0, 1, 2, 2, 3, 6, 6]  # expert 2's 5 pairs take 2 blocks; spare blocks: E (skipped)
