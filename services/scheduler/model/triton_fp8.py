"""FP8 linear (W8A8) for `fp8.Fp8Linear`; its reference is `Fp8Linear.w8a8_reference`, its CPU twin
`Fp8Linear.dequantized` + F.linear.

The weight W8 [N, K] comes with one scale per (bn, bk) tile (block-wise, Sw [N / bn, K / bk]) or one
per row (Sw [N], a tile of (1, K)). The activations are quantized inside the kernel, per token and
per BLOCK_K columns (the weight's bk for block-wise, `fp8.ACTIVATION_GROUP` for per-row), as each
K step loads them (`fp8.quantize_groups` in torch):
    sx[m, g] = max(|x[m, g-th group]|) / 448,   x8 = fp8(x / sx)
    y[m, n] = sum_g sx[m, g] * Sw[n, g] * sum_{k in group g} x8[m, k] * W8[n, k]
one FP8 tensor-core dot per K step, scaled and accumulated in fp32, rounded once to x's dtype.

Why W8A8 in decode too: a decode step reads each weight byte once, so its time is the weight's
bytes whatever the dot's inputs, and a token's quantization is the same in decode and prefill (the
checkpoints' own 1 x 128 activation scheme), whichever kernel runs it. Quantizing x inside costs a
few operations per activation element, re-done by each program that reads it: small next to the
weight tile the same step streams.

`tiles` picks the tiling by the step's rows. Decode-sized steps (M <= `fp8.DECODE_ROWS`) are
bandwidth-bound: the weight must stream from every SM at once, which a few N tiles cannot do
(N / 64 = 64 programs for a 4096-row projection, half an H100), so K is split too, until about
`PROGRAMS_PER_SM` programs per SM stream their own slice of the weight; each split writes fp32
partial sums [S, M, N] and `triton_matmul.sum_splits` adds them in split order (deterministic, no
atomics) and rounds once. Splits are whole K steps, so the activation groups, and the result up to
fp32 summation order, do not depend on the split. Larger steps take 64 x 128 tiles, split only while
they are too few to fill the SMs (a verify step of a few hundred tokens).

A one-token step (batch-1 decode) takes `_fp8_gemv_kernel` instead: a tensor-core dot needs 16 rows
at least, 15 of them zeros here, and its activation loads and scales serialise each K step. The GEMV
is triton_fused's `_gemv_kernel` for FP8: a program owns BLOCK_N output rows and streams its
[BLOCK_N, groups_per_step x bk] weight tiles along K in wide contiguous loads, upcast to fp32 in
registers and multiplied by the token's quantized activations (the same x8 and sx as above), summed
per lane in fp32 and reduced once (tl.sum) at the end. BLOCK_N divides the weight's bn, so a program's
rows share one block scale per K group: folded with sx into the activations once per step, which
leaves one upcast and one FMA per weight byte (per-row scales multiply the row's sum at the end).
x8 is the same: x / sx rounded to nearest from sx's correctly rounded reciprocal (`_div_rn_by`).
N / BLOCK_N programs fill the SMs at Qwen3's shapes; a weight with few rows splits K as above.

The GEMV takes the small op before it along (`llama.norm_linear` / `silu_linear` at one token with
the fused kernels on, as triton_fused's float GEMVs do): the residual add + RMSNorm before q/k/v and
gate/up (`fp8_norm_gemv`: each program sums the row's squares as triton_fused's norm kernel does,
pairwise, so with the same bits, while its first weight tile is in flight; program 0 writes the new
residual), SiLU(gate) * up before down (`fp8_silu_gemv`). Each program computes that input for the
columns it streams and rounds it to x's dtype where the unfused kernels write it out, then
quantizes it as above: the same bits as `add_rms_norm_triton` / `silu_mul_triton` then
`fp8_linear`, two launches and the activation's round trip fewer.
Grids follow the shapes only (CUDA graphs capture them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.scheduler.model.fp8 import ACTIVATION_GROUP, DECODE_ROWS, FP8_MAX
from services.scheduler.model.triton_fused import _check_gemv, _rms_scaled, _rounded_sum, _row_rstd, _silu_times_up, _summed_input
from services.scheduler.model.triton_matmul import sum_splits

PROGRAMS_PER_SM = 4  # decode: programs in flight per SM, each streaming its own slice of the weight
MIN_STEPS_PER_SPLIT = 4  # K steps a split keeps, so each program's loads still pipeline
DECODE_BLOCK_N = 64
HOPPER_SMS = 132  # off CUDA (the interpreter): the tiles an H100 would take
GEMV_ROWS = 1  # steps of this many tokens take the GEMV
GEMV_BLOCK_N = 16  # the GEMV's rows per program, halved while fewer than GEMV_PROGRAMS_PER_SM programs per SM
GEMV_PROGRAMS_PER_SM = 2  # at least; up to 4 of 4 warps fit an SM's registers, so Qwen3's projections run in about one wave
GEMV_STEP_BYTES = 8192  # weight bytes a GEMV program loads per K step: 64 a lane at 4 warps, four 16-byte loads
GEMV_WARPS = 4


@dataclass(frozen=True)
class Tiles:
    block_m: int  # GEMV_ROWS: the GEMV (BLOCK_N rows of the weight per program); else the tensor-core kernel's rows
    block_n: int
    splits: int  # programs along K; > 1: fp32 partial sums, added by `triton_matmul.sum_splits`
    steps_per_split: int  # BLOCK_K steps each split takes (K steps: BLOCK_K, or the GEMV's groups_per_step groups; the last may run past K: masked)
    num_stages: int
    groups_per_step: int = 1  # activation groups (bk columns) per K step
    num_warps: int = 4


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K, steps_per_split,
    stride_x, stride_w, stride_ws_n, stride_ws_k, stride_out_split, stride_out,
    GROUP_N: tl.constexpr, FP8_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    split = tl.program_id(2)
    ks = tl.arange(0, BLOCK_K)
    in_rows, in_cols = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * steps_per_split
    for group in range(first, first + steps_per_split):
        k = group * BLOCK_K + ks
        in_k = k < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :], mask=in_rows[:, None] & in_k[None, :], other=0.0)
        x = x.to(tl.float32)
        # divisions rounded to nearest, as torch divides (fp32 "/" is an approximate division on CUDA): x8 as `quantize_groups` gives it
        x_scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), FP8_LIMIT)  # [BM]
        x8 = tl.minimum(tl.maximum(tl.div_rn(x, x_scale[:, None]), -FP8_LIMIT), FP8_LIMIT).to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + k[:, None], mask=in_cols[None, :] & in_k[:, None], other=0.0)
        scale_col = tl.minimum(group, (K - 1) // BLOCK_K)  # a step past K (the last split's) reads a real scale, times 0
        w_scale = tl.load(w_scale_ptr + (cols // GROUP_N) * stride_ws_n + scale_col * stride_ws_k, mask=in_cols, other=0.0)  # [BN]
        acc += tl.dot(x8, w) * x_scale[:, None] * w_scale[None, :]
    out = out_ptr + split * stride_out_split + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, out_ptr, N, K, steps_per_split, stride_w, stride_ws_n, stride_ws_k, stride_out_split,
    residual_ptr, norm_weight_ptr, residual_out_ptr, eps,
    GROUP_N: tl.constexpr, FP8_LIMIT: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr,
    NORMED: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, HIDDEN: tl.constexpr, ROW_BLOCK: tl.constexpr,
):
    # One token x [K]; weight tiles [BLOCK_N, GROUPS, GROUP_K], a K step = GROUPS activation groups.
    # x is quantized by each program as it streams (x is L2-resident, and BLOCK_N weight bytes share each
    # of its elements): dearer in ALU than a quantizing kernel run once, but that kernel's launch and
    # x8's round trip would cost each projection more at one token. The input stage (module doc) is
    # computed the same way, by every program for the columns it streams: NORMED, x (+ residual) then
    # RMSNorm (HIDDEN = K columns, the row's rstd first); GATED, SiLU(x[:K]) * x[K:].
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    split = tl.program_id(1)
    groups = tl.arange(0, GROUPS)
    in_rows = rows < N
    rstd = tl.full([], 0.0, tl.float32)
    # block-wise: BLOCK_N divides GROUP_N, so the program's rows share their scales' row
    scale_row = w_scale_ptr + (tl.program_id(0) * BLOCK_N // GROUP_N) * stride_ws_n
    acc = tl.zeros((BLOCK_N, GROUPS, GROUP_K), dtype=tl.float32)
    first = split * steps_per_split
    for step in range(first, first + steps_per_split):
        group = step * GROUPS + groups  # [G]
        k = group[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]  # [G, GK]
        in_k = k < K
        # the weight's loads first: in flight while x is quantized (no prefetch of the next step: twice
        # the registers, half the programs resident per SM)
        w = tl.load(w_ptr + rows[:, None, None].to(tl.int64) * stride_w + k[None, :, :],
                    mask=in_rows[:, None, None] & in_k[None, :, :], other=0.0)  # fmt: skip
        if NORMED:  # the row's rstd while the first weight tile is in flight
            if step == first:
                writes_residual = (tl.program_id(0) == 0) & (split == 0)
                rstd = _summed_row_rstd(x_ptr, residual_ptr, residual_out_ptr, eps, writes_residual, HIDDEN, ROW_BLOCK,
                                        HAS_RESIDUAL)  # fmt: skip
        x = _gemv_input(x_ptr, residual_ptr, norm_weight_ptr, rstd, k, K, NORMED, HAS_RESIDUAL, GATED).to(tl.float32)
        w_scale = 1.0
        if GROUP_N > 1:  # a past-K group (the last split's) reads a real scale, times 0
            w_scale = tl.load(scale_row + tl.minimum(group, (K - 1) // GROUP_K) * stride_ws_k)  # [G]
        x_scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), FP8_LIMIT)  # [G]
        x8 = tl.minimum(tl.maximum(_div_rn_by(x, x_scale[:, None], tl.div_rn(1.0, x_scale)[:, None]), -FP8_LIMIT), FP8_LIMIT)
        x_scaled = x8.to(w_ptr.dtype.element_ty).to(tl.float32) * (x_scale * w_scale)[:, None]  # [G, GK]
        acc += w.to(tl.float32) * x_scaled[None, :, :]
    out = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    if GROUP_N == 1:  # per row: its scale times its sum
        out *= tl.load(w_scale_ptr + rows * stride_ws_n, mask=in_rows, other=0.0)
    tl.store(out_ptr + split * stride_out_split + rows, out.to(out_ptr.dtype.element_ty), mask=in_rows)


@triton.jit
def _summed_row_rstd(x_ptr, residual_ptr, residual_out_ptr, eps, writes_residual, HIDDEN: tl.constexpr, ROW_BLOCK: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):  # fmt: skip
    """The norm stage's rstd of the whole row x (+ residual), as triton_fused's norm kernel computes it
    (same ROW_BLOCK, same pairwise sum: the same bits); writes_residual: this program stores the sum."""
    cols = tl.arange(0, ROW_BLOCK)
    x = _summed_input(x_ptr, residual_ptr, cols, HIDDEN, HAS_RESIDUAL)
    if HAS_RESIDUAL:
        if writes_residual:
            tl.store(residual_out_ptr + cols, x, mask=cols < HIDDEN)
    return _row_rstd(x.to(tl.float32), eps, HIDDEN, ROW_BLOCK)


@triton.jit
def _gemv_input(x_ptr, residual_ptr, norm_weight_ptr, rstd, k, K, NORMED: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                GATED: tl.constexpr):  # fmt: skip
    """The GEMV's input at columns k (any shape), in x's dtype, 0 past K: x; or (NORMED) norm_weight *
    rms_norm(x + residual); or (GATED) SiLU(x[k]) * x[K + k]: each rounded where `add_rms_norm_triton`
    and `silu_mul_triton` round, which write it out for the unfused GEMV."""
    in_k = k < K
    x = tl.load(x_ptr + k, mask=in_k, other=0.0)
    if NORMED:
        if HAS_RESIDUAL:
            x = _rounded_sum(x, tl.load(residual_ptr + k, mask=in_k, other=0.0))
        norm_weight = tl.load(norm_weight_ptr + k, mask=in_k, other=0.0).to(tl.float32)
        x = _rms_scaled(x.to(tl.float32), rstd, norm_weight, x.dtype).to(x.dtype)
    if GATED:
        x = _silu_times_up(x, tl.load(x_ptr + K + k, mask=in_k, other=0.0)).to(x.dtype)
    return x


@triton.jit
def _div_rn_by(a, b, reciprocal):
    """a / b rounded to nearest (as torch divides) from b's correctly rounded reciprocal, shared by
    a group: Markstein's correction, q + (a - q b) / b, exact without overflow or underflow."""
    q = a * reciprocal
    return tl.fma(tl.fma(-q, b, a), reciprocal, q)


def tiles(num_rows: int, out_features: int, in_features: int, block_k: int, num_sms: int = HOPPER_SMS, group_n: int = 1) -> Tiles:
    """The tiling of a step of `num_rows` tokens through an [N, K] weight whose scales cover group_n
    rows x block_k columns (group_n 1: a scale per row) (module doc)."""
    if num_rows == GEMV_ROWS:
        return gemv_tiles(out_features, in_features, block_k, num_sms, group_n)
    return tensor_core_tiles(num_rows, out_features, in_features, block_k, num_sms)


def tensor_core_tiles(num_rows: int, out_features: int, in_features: int, block_k: int, num_sms: int = HOPPER_SMS) -> Tiles:
    """`_fp8_linear_kernel`'s tiling of a step of `num_rows` tokens (module doc)."""
    decode = num_rows <= DECODE_ROWS
    block_m = max(16, triton.next_power_of_2(num_rows)) if decode else 64
    block_n = DECODE_BLOCK_N if decode else 128
    steps = triton.cdiv(in_features, block_k)
    # split only where it at least doubles the programs: each split costs the partials' pass
    wanted = PROGRAMS_PER_SM * num_sms // (triton.cdiv(num_rows, block_m) * triton.cdiv(out_features, block_n))
    # the partial sums (S x M x N fp32, written then read) stay under half the weight's N x K bytes
    splits = max(1, min(wanted, steps // MIN_STEPS_PER_SPLIT, in_features // (8 * num_rows)))
    per_split = triton.cdiv(steps, splits)
    return Tiles(block_m, block_n, triton.cdiv(steps, per_split), per_split, 4 if decode else 3)


def gemv_tiles(out_features: int, in_features: int, block_k: int, num_sms: int = HOPPER_SMS, group_n: int = 1,
               block_n: int | None = None, step_k: int | None = None, num_warps: int = GEMV_WARPS) -> Tiles:  # fmt: skip
    """The GEMV's tiling of one token through an [N, K] weight. block_n rows per program (a divisor of
    group_n when group_n > 1); by default GEMV_BLOCK_N, halved while the programs would not reach
    GEMV_PROGRAMS_PER_SM per SM. step_k columns a K step (whole activation groups; by default
    GEMV_STEP_BYTES a step). K is split where the rows alone give too few programs."""
    if block_n is None:
        block_n = GEMV_BLOCK_N
        while block_n > 1 and triton.cdiv(out_features, block_n) < GEMV_PROGRAMS_PER_SM * num_sms:
            block_n //= 2
    block_n = min(block_n, group_n & -group_n) if group_n > 1 else block_n  # the largest power of two dividing group_n
    step_k = step_k or GEMV_STEP_BYTES // max(block_n, 8)  # at most 1024 columns: a few-row weight's K still splits
    groups_per_step = min(_floor_power_of_2(max(1, step_k // block_k)), triton.next_power_of_2(triton.cdiv(in_features, block_k)))
    steps = triton.cdiv(in_features, groups_per_step * block_k)
    wanted = GEMV_PROGRAMS_PER_SM * num_sms // triton.cdiv(out_features, block_n)
    per_split = triton.cdiv(steps, max(1, min(wanted, steps // MIN_STEPS_PER_SPLIT)))
    return Tiles(GEMV_ROWS, block_n, triton.cdiv(steps, per_split), per_split, 1, groups_per_step, num_warps)


def _floor_power_of_2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None, plan: Tiles | None = None
) -> torch.Tensor:
    """x [..., K] @ (W8 [N, K], scales per tile [N / bn, K / bk] or per row [N])^T -> [..., N] in x's dtype.
    plan: the tiling (`tiles`' choice by default; a GEMV's needs one row and block_n dividing bn)."""
    flat = x.reshape(-1, x.shape[-1])
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    num_rows, (n, k) = flat.shape[0], weight.shape
    group_n, block_k, stride_ws = _scale_layout(weight_scale, block)
    plan = plan or tiles(num_rows, n, k, block_k, num_sms(x.device), group_n)
    if plan.block_m == GEMV_ROWS:
        return _gemv(flat, weight, weight_scale, block, plan).view(*x.shape[:-1], n)
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    partial = out if plan.splits == 1 else torch.empty(plan.splits, num_rows, n, dtype=torch.float32, device=x.device)
    _fp8_linear_kernel[(triton.cdiv(num_rows, plan.block_m), triton.cdiv(n, plan.block_n), plan.splits)](
        flat, weight, weight_scale, partial, num_rows, n, k, plan.steps_per_split,
        flat.stride(0), weight.stride(0), *stride_ws, num_rows * n, n,
        GROUP_N=group_n, FP8_LIMIT=FP8_MAX, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=block_k,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    if plan.splits > 1:
        sum_splits(partial, out)
    return out.view(*x.shape[:-1], n)


def fp8_norm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None, plan: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [1, K] -> (fp8_linear(norm_weight * rms_norm(x + residual)), x + residual) in one launch,
    the same bits as `add_rms_norm_triton` then `fp8_linear`; residual None: (..., x). norm_weight in x's dtype."""
    summed = x if residual is None else torch.empty_like(x)
    norm = (x if residual is None else residual, norm_weight, summed, eps)
    return _gemv(x, weight, weight_scale, block, plan, norm=norm, has_residual=residual is not None), summed


def fp8_silu_gemv(
    gate_up: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None, plan: Tiles | None = None
) -> torch.Tensor:
    """gate_up [1, 2I] = [gate | up] -> fp8_linear(SiLU(gate) * up) [1, N] in one launch, the same bits
    as `silu_mul_triton` then `fp8_linear`."""
    return _gemv(gate_up, weight, weight_scale, block, plan, gated=True)


def _gemv(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None, plan: Tiles | None,
    norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None, has_residual: bool = False, gated: bool = False,
) -> torch.Tensor:
    """`_fp8_gemv_kernel` on one token x [1, K] ([1, 2K] gated) -> [1, N]; norm: (residual, norm weight,
    the sum's output, eps) of the norm stage."""
    (n, k), (group_n, block_k, stride_ws) = weight.shape, _scale_layout(weight_scale, block)
    _check_gemv(x, weight, x.shape[1] // 2 if gated else x.shape[1])
    plan = plan or gemv_tiles(n, k, block_k, num_sms(x.device), group_n)
    assert plan.block_m == GEMV_ROWS and (group_n == 1 or group_n % plan.block_n == 0), plan
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    partial = out if plan.splits == 1 else torch.empty(plan.splits, 1, n, dtype=torch.float32, device=x.device)
    residual, norm_weight, summed, eps = norm or (x, x, x, 0.0)  # unread without the norm stage
    _fp8_gemv_kernel[(triton.cdiv(n, plan.block_n), plan.splits)](
        x, weight, weight_scale, partial, n, k, plan.steps_per_split, weight.stride(0), *stride_ws, n,
        residual, norm_weight, summed, eps,
        GROUP_N=group_n, FP8_LIMIT=FP8_MAX, BLOCK_N=plan.block_n, GROUPS=plan.groups_per_step, GROUP_K=block_k,
        NORMED=norm is not None, HAS_RESIDUAL=has_residual, GATED=gated,
        HIDDEN=k if norm else 0, ROW_BLOCK=triton.next_power_of_2(k) if norm else 0,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    if plan.splits > 1:
        sum_splits(partial, out)
    return out


def _scale_layout(weight_scale: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int, tuple[int, int]]:
    """(rows a scale covers, columns a scale covers, scale strides (row, K step)) of the weight's scales."""
    if block is None:  # a row's scale for every K step
        return 1, ACTIVATION_GROUP, (weight_scale.stride(0), 0)
    return block[0], block[1], (weight_scale.stride(0), weight_scale.stride(1))


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return HOPPER_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count  # a fixed property of the card
