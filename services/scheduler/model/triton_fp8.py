"""Block-wise FP8 linear (W8A8) for `fp8.Fp8Linear`; its twin is `Fp8Linear.dequantized` + F.linear.

The weight W8 [N, K] comes with one scale per (bn, bk) tile, Sw [N / bn, K / bk]; the activations are
quantized here per token and per bk columns (`quantize_groups`: Sx [M, K / bk], amax / 448). Then
    y[m, n] = sum_g Sx[m, g] * Sw[n // bn, g] * sum_{k in group g} x8[m, k] * W8[n, k]
one FP8 tensor-core dot per K group, scaled and accumulated in fp32, rounded once to x's dtype.
Grids follow the shapes only (CUDA graphs capture it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.scheduler.model.fp8 import FP8, FP8_MAX


@triton.jit
def _block_fp8_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K,
    stride_a, stride_as, stride_w, stride_ws, stride_out,
    GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # BLOCK_K is the scale group's width: one activation and one weight scale per K step.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ks = tl.arange(0, BLOCK_K)
    in_rows, in_cols = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for group in range(0, tl.cdiv(K, BLOCK_K)):
        k = group * BLOCK_K + ks
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_a + k[None, :], mask=in_rows[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + k[:, None], mask=in_cols[None, :] & (k < K)[:, None], other=0.0)
        a_scale = tl.load(a_scale_ptr + rows * stride_as + group, mask=in_rows, other=0.0)  # [BM]
        w_scale = tl.load(w_scale_ptr + (cols // GROUP_N) * stride_ws + group, mask=in_cols, other=0.0)  # [BN]
        acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], fp32 scales [M, K / group]): one scale per token and `group` columns."""
    rows, cols = x.shape
    if cols % group:
        raise ValueError(f"block-wise FP8 needs in_features ({cols}) to be a multiple of the scale block ({group})")
    grouped = x.float().reshape(rows, cols // group, group)
    scale = grouped.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [M, K / group]
    return (grouped / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, cols), scale


def tiles(num_rows: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): decode-sized steps take short, narrow tiles so more programs stream the weight."""
    return (16, 64) if num_rows <= 16 else (64, 128)


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [..., K] @ (W8 [N, K] with tile scales [N / bn, K / bk])^T -> [..., N] in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_groups(flat, block[1])
    num_rows, (n, k) = flat.shape[0], weight.shape
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    block_m, block_n = tiles(num_rows)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n, block_n))
    _block_fp8_kernel[grid](
        x_q, x_scale, weight, weight_scale, out, num_rows, n, k,
        x_q.stride(0), x_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        GROUP_N=block[0], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block[1],
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
