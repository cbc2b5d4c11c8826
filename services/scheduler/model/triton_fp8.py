"""FP8 linear (W8A8) for `fp8.Fp8Linear`; its twin is `Fp8Linear.dequantized` + F.linear.

The weight W8 [N, K] comes with one scale per (bn, bk) tile (block-wise, Sw [N / bn, K / bk]) or one
per row (Sw [N], a tile of (1, K)). The activations are quantized inside the kernel, per token and
per BLOCK_K columns (the weight's bk for block-wise), as each K step loads them:
    sx[m, g] = max(|x[m, g-th group]|) / 448,   x8 = fp8(x / sx)
    y[m, n] = sum_g sx[m, g] * Sw[n, g] * sum_{k in group g} x8[m, k] * W8[n, k]
one FP8 tensor-core dot per K step, scaled and accumulated in fp32, rounded once to x's dtype: one
launch per projection (the activation's quantization is no kernels of its own; every N tile
quantizes the same few rows again, which costs nothing next to streaming the weight).
`quantize_groups` is the same quantization in torch (the tests' reference). Grids follow the
shapes only (CUDA graphs capture it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.scheduler.model.fp8 import FP8, FP8_MAX

ROW_SCALE_BLOCK_K = 128  # per-row weights: the activations' group along K


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K,
    stride_x, stride_w, stride_ws_n, stride_ws_k, stride_out,
    GROUP_N: tl.constexpr, FP8_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ks = tl.arange(0, BLOCK_K)
    in_rows, in_cols = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for group in range(0, tl.cdiv(K, BLOCK_K)):
        k = group * BLOCK_K + ks
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :], mask=in_rows[:, None] & (k < K)[None, :], other=0.0)
        x = x.to(tl.float32)
        x_scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / FP8_LIMIT  # [BM]
        x8 = tl.minimum(tl.maximum(x / x_scale[:, None], -FP8_LIMIT), FP8_LIMIT).to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + k[:, None], mask=in_cols[None, :] & (k < K)[:, None], other=0.0)
        w_scale = tl.load(w_scale_ptr + (cols // GROUP_N) * stride_ws_n + group * stride_ws_k, mask=in_cols, other=0.0)  # [BN]
        acc += tl.dot(x8, w) * x_scale[:, None] * w_scale[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch: x [M, K] -> (FP8 [M, K], fp32 scales [M, K / group])."""
    rows, cols = x.shape
    grouped = x.float().reshape(rows, cols // group, group)
    scale = grouped.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [M, K / group]
    return (grouped / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, cols), scale


def tiles(num_rows: int, out_features: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): decode-sized steps take short, narrow tiles, so that enough programs stream the weight."""
    if num_rows <= 16:
        return 16, 32 if out_features <= 8192 else 64
    return 64, 128


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """x [..., K] @ (W8 [N, K], scales per tile [N / bn, K / bk] or per row [N])^T -> [..., N] in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    num_rows, (n, k) = flat.shape[0], weight.shape
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    block_m, block_n = tiles(num_rows, n)
    if block is None:  # a row's scale for every K step
        group_n, block_k, stride_ws = 1, ROW_SCALE_BLOCK_K, (weight_scale.stride(0), 0)
    else:
        group_n, block_k, stride_ws = block[0], block[1], (weight_scale.stride(0), weight_scale.stride(1))
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n, block_n))
    _fp8_linear_kernel[grid](
        flat, weight, weight_scale, out, num_rows, n, k, flat.stride(0), weight.stride(0), *stride_ws, out.stride(0),
        GROUP_N=group_n, FP8_LIMIT=FP8_MAX, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, num_stages=4 if num_rows <= 16 else 3,
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
