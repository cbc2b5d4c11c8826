"""The fused mixture-of-experts kernel (twin: `moe.experts_reference`): every (token, expert) pair of
a step in two grouped GEMMs.

1. `align_to_blocks`: the T*k pairs sorted by expert, each expert's run padded to a multiple of
   BLOCK_M with the invalid pair id T*k, so each block of BLOCK_M rows belongs to one expert. The
   buffer's size, the step's expert capacity, follows from the batch alone: at most min(E, T*k)
   experts are hit and each pads by at most BLOCK_M - 1, so T*k + min(E, T*k) * (BLOCK_M - 1) rows.
   One program (`_align_kernel`: counts, padded runs, each pair's place, each block's expert) in
   place of ~20 torch ops a layer; its twin `align_to_blocks_torch` gives the same buffers.
2. `_grouped_gemm_kernel` over (block, N tile): gate/up = x[pair // k] @ W13[e]^T, then, after
   SiLU(gate) * up, down = h[pair] @ W2[e]^T; fp32 sums, each output rounded to x's dtype; a block
   past the last expert's run exits at once.
3. `moe.combine`, as the twin: each pair's row times its router weight, summed per token in fp32.
FP8 expert stacks (`scales`: their fp32 scales, per row or per (bn, bk) tile) are read as FP8, half
the bytes of bf16: each K step's tile is upcast to the activations' dtype (exactly: e4m3 values fit
bf16) and its dot times the step's scales [BN] is added in fp32 (BLOCK_K divides bk, so one scale
per column and step).
Grids and buffers follow the shapes only, so CUDA graphs capture the whole layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.scheduler.model.llama import silu_mul
from services.scheduler.model.moe import combine


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, block_experts_ptr, num_pairs, N, K,
    stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_out,
    ROWS_PER_PAIR_DIV: tl.constexpr, NUM_EXPERTS: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # out[pair, n] = sum_k a[pair // DIV, k] * w[expert, n, k] (* s[expert, n // GROUP_N, k // GROUP_K]) for the block's pairs.
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert >= NUM_EXPERTS:
        return
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = pairs < num_pairs
    rows = (pairs // ROWS_PER_PAIR_DIV).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = k0 + ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_a + (k0 + ks)[None, :], mask=valid[:, None] & in_k[None, :], other=0.0)
        w_tile = w_ptr + expert * stride_we + cols[None, :] * stride_wn + (k0 + ks)[:, None]
        w = tl.load(w_tile, mask=(cols < N)[None, :] & in_k[:, None], other=0.0)  # [BK, BN]
        if SCALED:
            scale = tl.load(s_ptr + expert * stride_se + (cols // GROUP_N) * stride_sn + (k0 // GROUP_K) * stride_sk,
                            mask=cols < N, other=0.0)  # [BN]  # fmt: skip
            acc += _dot(a, w.to(a.dtype), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), IEEE) * scale[None, :]
        else:
            acc = _dot(a, w, acc, IEEE)
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols < N)[None, :])


@triton.jit
def _dot(a, w, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w, acc)


def capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted pair buffer: every pair, plus each hit expert's padding, in whole blocks."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ptr, block_experts_ptr, num_pairs, rows, num_blocks,
    NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):
    # One program; pairs are read CHUNK at a time against every expert at once ([CHUNK, E] one-hots).
    experts = tl.arange(0, EXPERTS_POW2)
    counts = tl.zeros((EXPERTS_POW2,), dtype=tl.int64)
    for start in range(0, num_pairs, CHUNK):
        onehot = _onehot(ids_ptr, start, num_pairs, experts, CHUNK)
        counts += tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E]
    run_ends = tl.cumsum(padded, axis=0)
    for start in range(0, rows, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int64) + num_pairs, mask=offs < rows)
    tl.debug_barrier()  # the padding written before any pair's place
    taken = run_ends - padded  # [E]: the next free row of each expert's run
    for start in range(0, num_pairs, CHUNK):
        onehot = _onehot(ids_ptr, start, num_pairs, experts, CHUNK)
        before = tl.cumsum(onehot, axis=0) - onehot  # [CHUNK, E]: earlier pairs of the chunk with the same expert
        place = tl.sum(onehot * (taken[None, :] + before), axis=1)  # [CHUNK]
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + place, offs.to(tl.int64), mask=offs < num_pairs)
        taken += tl.sum(onehot, axis=0)
    real = experts < NUM_EXPERTS
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        ended = (run_ends[None, :] <= (blocks * BLOCK_M)[:, None]) & real[None, :]  # runs over before the block
        tl.store(block_experts_ptr + blocks, tl.sum(ended.to(tl.int64), axis=1), mask=blocks < num_blocks)


@triton.jit
def _onehot(ids_ptr, start, num_pairs, experts, CHUNK: tl.constexpr):
    offs = start + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    return (ids[:, None] == experts[None, :]).to(tl.int64)  # [CHUNK, E]


def align_to_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (pair ids sorted by expert, runs padded to BLOCK_M with T*k [P], each block's expert
    [P / BLOCK_M], num_experts past the last run); pairs of one expert in pair order."""
    flat = ids.flatten().contiguous()
    rows = capacity(flat.numel(), num_experts, block_m)
    sorted_pairs = torch.empty(rows, dtype=torch.int64, device=ids.device)
    block_experts = torch.empty(rows // block_m, dtype=torch.int64, device=ids.device)
    _align_kernel[(1,)](
        flat, sorted_pairs, block_experts, flat.numel(), rows, rows // block_m,
        NUM_EXPERTS=num_experts, EXPERTS_POW2=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=32, num_warps=4,
    )  # fmt: skip
    return sorted_pairs, block_experts


def align_to_blocks_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_to_blocks` in torch ops (its twin, in the tests)."""
    flat = ids.flatten()  # [N]
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    run_ends = padded.cumsum(0)  # [E]
    order = torch.sort(flat, stable=True).indices  # pairs grouped by expert, in pair order within one
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert_of]
    rows = capacity(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((rows,), num_pairs, dtype=torch.int64, device=ids.device)
    sorted_pairs[(run_ends - padded)[expert_of] + rank] = order
    block_starts = torch.arange(0, rows, block_m, device=ids.device)
    return sorted_pairs, torch.searchsorted(run_ends, block_starts, right=True)


def grouped_gemm(
    a: torch.Tensor, weights: torch.Tensor, sorted_pairs: torch.Tensor, block_experts: torch.Tensor, num_pairs: int,
    rows_per_pair_div: int, block_m: int, scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """out [num_pairs, N] = a[pair // div] @ weights[expert of pair]^T; FP8 weights with their `scale`
    (per row [E, N], or per `block` tile [E, N / bn, K / bk])."""
    num_experts, n, k = weights.shape
    out = a.new_empty(num_pairs, n)
    block_n, block_k = (64, 64) if a.dtype == torch.float32 else (128, 64)
    if scale is None:
        scale_args, group = (weights, 0, 0, 0), (1, block_k)
    elif block is None:
        scale_args, group = (scale, scale.stride(0), scale.stride(1), 0), (1, block_k)
    else:
        scale_args, group, block_k = (scale, *scale.stride()), block, min(block_k, block[1])
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, weights, scale_args[0], out, sorted_pairs, block_experts, num_pairs, n, k,
        a.stride(0), weights.stride(0), weights.stride(1), *scale_args[1:], out.stride(0),
        ROWS_PER_PAIR_DIV=rows_per_pair_div, NUM_EXPERTS=num_experts, IEEE=a.dtype == torch.float32, SCALED=scale is not None,
        GROUP_N=group[0], GROUP_K=group[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 while the average expert gets few pairs (decode), 64 once they fill a block."""
    return 16 if num_pairs <= 4 * num_experts else 64


def fused_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None] | None = None,
) -> torch.Tensor:
    """As `moe.experts_reference`: x [T, H], gate_up [E, 2I, H], down [E, H, I], weights fp32/ids [T, k] -> [T, H];
    FP8 stacks come with `scales` (gate_up's, down's, their tile or None for per-row)."""
    num_tokens, top_k = ids.shape
    num_pairs, num_experts = num_tokens * top_k, gate_up.shape[0]
    block_m = block_m_for(num_pairs, num_experts)
    sorted_pairs, block_experts = align_to_blocks(ids, num_experts, block_m)
    gate_up_scale, down_scale, block = scales if scales is not None else (None, None, None)
    x = x.contiguous()
    gate_up_out = grouped_gemm(x, gate_up, sorted_pairs, block_experts, num_pairs, top_k, block_m, gate_up_scale, block)
    hidden = silu_mul(gate_up_out, fused=x.is_cuda)
    return combine(grouped_gemm(hidden, down, sorted_pairs, block_experts, num_pairs, 1, block_m, down_scale, block), weights)
