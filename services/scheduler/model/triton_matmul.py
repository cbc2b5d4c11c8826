"""The batch-invariant GEMM (`batch_invariant.invariant_linear` on CUDA): out = x @ w^T (+ b), fp32 accumulation.

One program per (BLOCK_M x BLOCK_N) output tile and K split: split s walks its own `k_per_split`
columns from s * k_per_split in BLOCK_K steps, so a row's reduction order is fixed by (N, K) and the
tile configuration, which `batch_invariant.tile_config` picks from the weight's shape alone. With
one split the tile is rounded and stored as it stands; with several, each split stores fp32 partial
sums [S, M, N] and `sum_splits` adds them in split order and rounds once. M is never specialized on
(a one-row step compiles the same kernels as a 64-row one). Imported lazily, only where Triton is
(CUDA; the interpreter in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUM_BLOCK = 1024


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_out_split, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    split = tl.program_id(2)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + k[None, :], mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)  # [BM, BN]
    if HAS_BIAS:
        if split == 0:  # once per output: the first split's partial carries it
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    out = out_ptr + split.to(tl.int64) * stride_out_split + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, numel, splits, BLOCK: tl.constexpr):
    # out[i] = sum_s partial[s, i] in split order, rounded once to out's dtype
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(0, splits):
        total += tl.load(partial_ptr + split * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A split-K GEMM's last pass: out [M, N] (contiguous) = the fp32 partial sums [S, M, N] added in
    split order 0, 1, ... (no atomics: the same bits every run), rounded once to out's dtype."""
    numel = out.numel()
    _sum_splits_kernel[(triton.cdiv(numel, SUM_BLOCK),)](partial, out, numel, partial.shape[0], BLOCK=SUM_BLOCK)
    return out


def launch_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, config) -> torch.Tensor:
    """x [M, K] (rows contiguous), weight [N, K] (rows contiguous), out [M, N] (contiguous where
    config splits K); config: a `TileConfig`, whose `splits` cut K into whole BLOCK_K steps."""
    m, k = x.shape
    n = weight.shape[0]
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    steps = triton.cdiv(k, config.block_k)
    k_per_split = triton.cdiv(steps, config.splits) * config.block_k
    splits = triton.cdiv(k, k_per_split)
    # the fp32 partials come from torch's caching allocator: a CUDA graph's capture takes them from its pool
    partial = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), splits)
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, partial, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), m * n, partial.stride(-2),
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out if splits == 1 else sum_splits(partial, out)
