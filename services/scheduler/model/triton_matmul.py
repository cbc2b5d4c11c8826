"""The batch-invariant GEMM (`batch_invariant.invariant_linear` on CUDA): out = x @ w^T (+ b), fp32 accumulation.

One program per (BLOCK_M x BLOCK_N) output tile; it walks K from 0 in BLOCK_K steps, so a row's
reduction order is fixed by (N, K) and the tile configuration, which `batch_invariant.tile_config`
picks from the weight's shape alone. M is never specialized on (a one-row step compiles the same
kernel as a 64-row one). Imported lazily, only where Triton is (CUDA; the interpreter in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + k[None, :], mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)  # [BM, BN]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, config) -> torch.Tensor:
    """x [M, K] (rows contiguous), weight [N, K] (rows contiguous), out [M, N]; config: a `TileConfig`."""
    m, k = x.shape
    n = weight.shape[0]
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
