"""Triton kernels for the small ops between a decoder layer's matmuls: fewer launches per step.

Imported lazily, only when `CausalLM.fused_kernels` is on (CUDA; Triton's interpreter in tests).
Each kernel computes what its torch twin in `llama.py` computes, rounding where it rounds:

- `add_rms_norm_triton` (twin `llama.add_rms_norm`): x + residual rounded once to x's dtype (the
  new residual), normalised in fp32, rounded, then times the weight (rounded): 1 launch for 3;
- `rotate_and_store_triton` (twin `Attention.rotate_and_store`): per head of one token, Qwen3's
  RMSNorm (as above), then rotate-half RoPE (x * cos rounded, plus rotated * sin, rounded once, as
  torch's addcmul), q stored, k and v written to the paged cache at the token's slot: 1 launch for
  ~9 (norms, cat, neg, mul, addcmul, split, two index copies);
- `silu_mul_triton` (twin `llama.silu_mul`): SiLU(gate) in fp32 rounded, times up, rounded: 1 for 2.

Every launch's grid and outputs follow the input shapes only: no host sync, no data-dependent
allocation, so CUDA graphs capture them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
    stride_x, stride_r, stride_o, stride_ro, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    # One program per token row.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=in_row, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=in_row)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / HIDDEN + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=in_row)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] (rows contiguous) -> (weight * rms_norm(x + residual), x + residual);
    residual None: (weight * rms_norm(x), x)."""
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1), "rows must be contiguous"
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = x if residual is None else torch.empty_like(x)
    residual_in = x if residual is None else residual  # unread without a residual
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(num_tokens,)](
        x, residual_in, weight, out, summed, eps,
        x.stride(0), residual_in.stride(0), out.stride(0), summed.stride(0),
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=_warps(block),
    )  # fmt: skip
    return out, summed


@triton.jit
def _head_rms_norm(x, x_partner, weight_ptr, d, partner, eps, HEAD_DIM: tl.constexpr):
    """RMSNorm of one head row x [D] (and the same row read at the rotate-half partner lanes)."""
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / HEAD_DIM + eps)
    dtype = x.dtype
    weight = tl.load(weight_ptr + d).to(tl.float32)
    weight_partner = tl.load(weight_ptr + partner).to(tl.float32)
    normed = ((xf * rstd).to(dtype).to(tl.float32) * weight).to(dtype)
    normed_partner = ((x_partner.to(tl.float32) * rstd).to(dtype).to(tl.float32) * weight_partner).to(dtype)
    return normed, normed_partner


@triton.jit
def _rope(x, x_partner, cos, sin, d, HEAD_DIM: tl.constexpr):
    """Rotate-half RoPE of one head row: x * cos (rounded) + [-x2, x1] * sin, rounded once."""
    dtype = x.dtype
    rotated = tl.where(d < HEAD_DIM // 2, -x_partner.to(tl.float32), x_partner.to(tl.float32))
    x_cos = (x.to(tl.float32) * cos.to(tl.float32)).to(dtype)
    return (x_cos.to(tl.float32) + rotated * sin.to(tl.float32)).to(dtype)


@triton.jit
def _rotate_and_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, key_cache_ptr, value_cache_ptr, q_weight_ptr, k_weight_ptr, eps,
    stride_qkv, stride_cos, stride_sin, stride_qo, stride_cache_block, stride_cache_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    # One program per (token, head): heads 0 .. Hq - 1 are q heads, Hq .. Hq + Hkv - 1 the kv heads
    # (k normed, rotated and written; v copied). qkv row: [q heads | k heads | v heads], D each.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    row = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    x = tl.load(row + d)
    x_partner = tl.load(row + partner)
    cos = tl.load(cos_ptr + token * stride_cos + d)
    sin = tl.load(sin_ptr + token * stride_sin + d)
    if head < NUM_HEADS:
        if QK_NORM:
            x, x_partner = _head_rms_norm(x, x_partner, q_weight_ptr, d, partner, eps, HEAD_DIM)
        q = _rope(x, x_partner, cos, sin, d, HEAD_DIM)
        tl.store(q_out_ptr + token * stride_qo + head * HEAD_DIM + d, q.to(q_out_ptr.dtype.element_ty))
    else:
        kv_head = head - NUM_HEADS
        if QK_NORM:
            x, x_partner = _head_rms_norm(x, x_partner, k_weight_ptr, d, partner, eps, HEAD_DIM)
        k = _rope(x, x_partner, cos, sin, d, HEAD_DIM)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        at = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot + kv_head * HEAD_DIM + d
        tl.store(key_cache_ptr + at, k.to(key_cache_ptr.dtype.element_ty))
        v = tl.load(row + NUM_KV_HEADS * HEAD_DIM + d)
        tl.store(value_cache_ptr + at, v.to(value_cache_ptr.dtype.element_ty))


def rotate_and_store_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_heads: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] (rows contiguous); cos, sin [T, 1, D] (`rope_cos_sin`); slot_mapping [T];
    caches [N, block_size, Hkv, D] (one layer's, same strides); qk_norm (q weight [D], k weight [D], eps)
    or None -> q [T, Hq, D]; k and v written to the caches at each token's slot."""
    num_tokens = qkv.shape[0]
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    assert qkv.stride(1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1, "rows must be contiguous"
    assert value_cache.stride() == key_cache.stride() and key_cache.stride(2) == head_dim and key_cache.stride(3) == 1
    if head_dim & (head_dim - 1):  # tl.arange needs a power of two (so does the paged decode kernel)
        raise ValueError(f"the fused RoPE kernel needs a power-of-two head_dim, not {head_dim}: serve with --no-fused-kernels")
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)  # weights unread without norms
    _rotate_and_store_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, cos, sin, slot_mapping, q, key_cache, value_cache, q_weight, k_weight, eps,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), key_cache.stride(0), key_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        QK_NORM=qk_norm is not None, num_warps=1,
    )  # fmt: skip
    return q


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr):
    # One program per (token, BLOCK columns of the intermediate).
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < INTERMEDIATE
    gate = tl.load(gate_up_ptr + token * stride_in + cols, mask=in_row, other=0.0)
    up = tl.load(gate_up_ptr + token * stride_in + INTERMEDIATE + cols, mask=in_row, other=0.0)
    gate_f = gate.to(tl.float32)
    silu = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=in_row)


SILU_BLOCK = 1024


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] = [gate | up] (rows contiguous) -> SiLU(gate) * up [T, I]."""
    num_tokens, width = gate_up.shape
    assert gate_up.stride(1) == 1, "rows must be contiguous"
    intermediate = width // 2
    out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    block = min(SILU_BLOCK, triton.next_power_of_2(intermediate))
    _silu_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTERMEDIATE=intermediate, BLOCK=block, num_warps=_warps(block)
    )
    return out


def _warps(block: int) -> int:
    """Warps for a row of `block` elements: 4 up to 1024 elements (8 per thread at most), 8 past them."""
    return 4 if block <= 1024 else 8
