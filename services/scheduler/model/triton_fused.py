"""Triton kernels for the small ops between a decoder layer's matmuls: fewer launches per step.

Imported lazily, only when `CausalLM.fused_kernels` is on (CUDA; Triton's interpreter in tests).
Each kernel computes what its torch twin in `llama.py` computes, rounding where it rounds:

- `add_rms_norm_triton` (twin `llama.add_rms_norm`): x + residual rounded once to x's dtype (the
  new residual), normalised in fp32 (the squares summed pairwise, `_row_rstd`: the same bits in
  `triton_fp8`'s norm stage), rounded, then times the weight (rounded): 1 launch for 3;
- `rotate_and_store_triton` (twin `Attention.rotate_and_store`): per head of one token, Qwen3's
  RMSNorm (as above), then rotate-half RoPE (x * cos rounded, plus rotated * sin, rounded once, as
  torch's addcmul), q stored, k and v written to the paged cache at the token's slot: 1 launch for
  ~9 (norms, cat, neg, mul, addcmul, split, two index copies);
- `silu_mul_triton` (twin `llama.silu_mul`): SiLU(gate) in fp32 rounded, times up, rounded: 1 for 2;
- at one token (a batch-1 decode step: `llama.GEMV_TOKENS`), the matmul on either side of a small op as
  a GEMV in the same launch: `norm_gemv_triton` (twin `llama.norm_linear`: the add + RMSNorm above,
  then the linear, fp32 sums) before q/k/v and gate/up, `silu_gemv_triton` (twin `llama.silu_linear`:
  SiLU * up as above, then down's linear): 3 launches a layer fewer; and o_proj's alone
  (`gemv_triton`, twin `llama.project`), where cuBLAS is slow for a weight as small as the 0.6B's.
  Their sums run in another order than cuBLAS's, so these match their twins to fp32 rounding, not
  bit for bit. FP8 weights take `triton_fp8`'s GEMV with the same input stages.

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
    UNIT_OFFSET: tl.constexpr,
):
    # One program per token row. UNIT_OFFSET: Gemma's norm, x * rstd * (1 + weight) in fp32, rounded once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=0.0)
    if HAS_RESIDUAL:
        x = _rounded_sum(x, tl.load(residual_ptr + row * stride_r + cols, mask=in_row, other=0.0))
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=in_row)
    xf = x.to(tl.float32)
    rstd = _row_rstd(xf, eps, HIDDEN, BLOCK)
    weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        out = xf * rstd * (1.0 + weight)
    else:
        out = _rms_scaled(xf, rstd, weight, x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _row_rstd(xf, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr):
    """1 / sqrt(mean(xf^2) + eps) of a row xf [BLOCK] (fp32, 0 past HIDDEN). Each square is rounded on
    its own (an fma with 0: never contracted into the adds), then neighbours are added in pairs, the
    pairs' sums in pairs, and so on: every add takes one pair, so the bits do not depend on how a
    kernel lays the row over its warps (`triton_fp8`'s norm stage gets this kernel's)."""
    sums = tl.fma(xf, xf, 0.0)
    for level in tl.static_range(16):  # rows up to 2^16 columns
        if (BLOCK >> level) > 1:
            sums = tl.sum(tl.reshape(sums, [BLOCK >> (level + 1), 2]), axis=1)
    return tl.math.rsqrt(tl.sum(sums, axis=0) / HIDDEN + eps)


@triton.jit
def _rounded_sum(x, residual):
    """x + residual in fp32, rounded once to x's dtype (torch's add)."""
    return (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)


@triton.jit
def _rms_scaled(xf, rstd, weight, dtype: tl.constexpr):
    """RMSNorm's tail in fp32: x * rstd rounded to dtype (F.rms_norm's output), times the fp32 weight."""
    return (xf * rstd).to(dtype).to(tl.float32) * weight


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] (rows contiguous) -> (weight * rms_norm(x + residual), x + residual);
    residual None: (weight * rms_norm(x), x). unit_offset: Gemma's (1 + weight), in x's dtype
    (twin `gemma.GemmaRMSNorm`)."""
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1), "rows must be contiguous"
    out = torch.empty(x.shape, dtype=x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = x if residual is None else torch.empty_like(x)
    residual_in = x if residual is None else residual  # unread without a residual
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(num_tokens,)](
        x, residual_in, weight, out, summed, eps,
        x.stride(0), residual_in.stride(0), out.stride(0), summed.stride(0),
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, num_warps=_warps(block),
    )  # fmt: skip
    return out, summed


@triton.jit
def _head_rms_norm(x, x_partner, weight, weight_partner, eps, HEAD_DIM: tl.constexpr):
    """RMSNorm of head rows x [H, D] (and the same rows read at the rotate-half partner lanes), weights [H, D]."""
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]
    dtype = x.dtype
    normed = ((xf * rstd).to(dtype).to(tl.float32) * weight).to(dtype)
    normed_partner = ((x_partner.to(tl.float32) * rstd).to(dtype).to(tl.float32) * weight_partner).to(dtype)
    return normed, normed_partner


@triton.jit
def _rope(x, x_partner, cos, sin, d, HEAD_DIM: tl.constexpr):
    """Rotate-half RoPE of head rows [H, D]: x * cos (rounded) + [-x2, x1] * sin, rounded once; cos, sin [1, D]."""
    dtype = x.dtype
    rotated = tl.where(d < HEAD_DIM // 2, -x_partner.to(tl.float32), x_partner.to(tl.float32))
    x_cos = (x.to(tl.float32) * cos.to(tl.float32)).to(dtype)
    return (x_cos.to(tl.float32) + rotated * sin.to(tl.float32)).to(dtype)


@triton.jit
def _rotate_and_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, key_cache_ptr, value_cache_ptr, q_weight_ptr, k_weight_ptr, eps,
    stride_qkv, stride_cos, stride_sin, stride_qo, stride_cache_block, stride_cache_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr, QK_NORM: tl.constexpr,
):
    # One program per (token, HEADS_PER_PROGRAM heads, a warp each) of the token's rotated heads: 0 .. Hq - 1 are
    # q heads, Hq .. Hq + Hkv - 1 the kv heads (k normed, rotated and written; v copied). The qkv row
    # is [q heads | k heads | v heads], D each, so rotated head h sits at h * D and its v (h >= Hq)
    # at (h + Hkv) * D. cos and sin are read once per program, for all its heads.
    token = tl.program_id(0).to(tl.int64)
    h = (tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM))[:, None]  # [H, 1]
    d = tl.arange(0, HEAD_DIM)[None, :]  # [1, D]
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    is_head = h < NUM_HEADS + NUM_KV_HEADS
    is_q, is_kv = h < NUM_HEADS, is_head & (h >= NUM_HEADS)
    row = qkv_ptr + token * stride_qkv + h * HEAD_DIM
    x = tl.load(row + d, mask=is_head, other=0.0)
    x_partner = tl.load(row + partner, mask=is_head, other=0.0)
    cos = tl.load(cos_ptr + token * stride_cos + d)
    sin = tl.load(sin_ptr + token * stride_sin + d)
    if QK_NORM:
        q_weight, k_weight = tl.load(q_weight_ptr + d).to(tl.float32), tl.load(k_weight_ptr + d).to(tl.float32)
        qp_weight, kp_weight = tl.load(q_weight_ptr + partner).to(tl.float32), tl.load(k_weight_ptr + partner).to(tl.float32)
        weight, weight_partner = tl.where(is_q, q_weight, k_weight), tl.where(is_q, qp_weight, kp_weight)
        x, x_partner = _head_rms_norm(x, x_partner, weight, weight_partner, eps, HEAD_DIM)
    rotated = _rope(x, x_partner, cos, sin, d, HEAD_DIM)
    tl.store(q_out_ptr + token * stride_qo + h * HEAD_DIM + d, rotated.to(q_out_ptr.dtype.element_ty), mask=is_q)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    at = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot + (h - NUM_HEADS) * HEAD_DIM + d
    tl.store(key_cache_ptr + at, rotated.to(key_cache_ptr.dtype.element_ty), mask=is_kv)
    v = tl.load(row + NUM_KV_HEADS * HEAD_DIM + d, mask=is_kv, other=0.0)
    tl.store(value_cache_ptr + at, v.to(value_cache_ptr.dtype.element_ty), mask=is_kv)


# Heads one program rotates, one warp each, so each head's norm sums its lanes in the order one head
# per program did: the result is bit for bit the same whatever the setting. At 8 heads a program,
# cos/sin are read once per 8 heads and a fifth as many programs launch: about as fast at one token,
# faster from a batch of decodes up to a long prompt.
ROPE_HEADS_PER_PROGRAM = 8


def rotate_and_store_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_heads: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    heads_per_program: int = ROPE_HEADS_PER_PROGRAM,
) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] (rows contiguous); cos, sin [T, 1, D] (`rope_cos_sin`); slot_mapping [T];
    caches [N, block_size, Hkv, D] (one layer's, same strides); qk_norm (q weight [D], k weight [D], eps)
    or None -> q [T, Hq, D]; k and v written to the caches at each token's slot. heads_per_program
    (a power of two, at most 16) only changes the launch, never the result."""
    num_tokens = qkv.shape[0]
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    assert qkv.stride(1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1, "rows must be contiguous"
    assert value_cache.stride() == key_cache.stride() and key_cache.stride(2) == head_dim and key_cache.stride(3) == 1
    if head_dim & (head_dim - 1):  # tl.arange needs a power of two (so does the paged decode kernel)
        raise ValueError(f"the fused RoPE kernel needs a power-of-two head_dim, not {head_dim}: serve with --no-fused-kernels")
    if heads_per_program & (heads_per_program - 1) or not 1 <= heads_per_program <= 16:
        raise ValueError(f"heads_per_program must be a power of two from 1 to 16, not {heads_per_program}")
    rotated_heads = num_heads + num_kv_heads
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)  # weights unread without norms
    _rotate_and_store_kernel[(num_tokens, triton.cdiv(rotated_heads, heads_per_program))](
        qkv, cos, sin, slot_mapping, q, key_cache, value_cache, q_weight, k_weight, eps,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), key_cache.stride(0), key_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_PER_PROGRAM=heads_per_program, QK_NORM=qk_norm is not None, num_warps=heads_per_program,
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
    tl.store(out_ptr + token * stride_out + cols, _silu_times_up(gate, up).to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _silu_times_up(gate, up):
    """SiLU(gate) in fp32 rounded to gate's dtype, times up, in fp32 (the caller rounds)."""
    gate_f = gate.to(tl.float32)
    silu = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype)
    return silu.to(tl.float32) * up.to(tl.float32)


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


# One-token GEMVs: a program computes BLOCK_N outputs, striding the input in BLOCK_K columns; its
# weight tile [BLOCK_N, BLOCK_K] is summed into fp32 per lane and reduced once at the end.


@triton.jit
def _norm_gemv_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, weight_ptr, bias_ptr, out_ptr, residual_out_ptr, eps, stride_w, N,
    HIDDEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    # Every program sums x (+ residual) and its squares itself (the row is HIDDEN values, in L2);
    # program 0 alone writes the sum out as the new residual.
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, HIDDEN, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x = _summed_input(x_ptr, residual_ptr, cols, HIDDEN, HAS_RESIDUAL).to(tl.float32)
        squares += x * x
        if HAS_RESIDUAL:
            if pid == 0:
                tl.store(residual_out_ptr + cols, x.to(dtype), mask=cols < HIDDEN)
    rstd = tl.math.rsqrt(tl.sum(squares, axis=0) / HIDDEN + eps)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, HIDDEN, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x = _summed_input(x_ptr, residual_ptr, cols, HIDDEN, HAS_RESIDUAL).to(tl.float32)
        norm_weight = tl.load(norm_weight_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
        normed = _rms_scaled(x, rstd, norm_weight, dtype).to(dtype)
        acc += _weight_tile(weight_ptr, rows, cols, stride_w, N, HIDDEN) * normed.to(tl.float32)[None, :]
    _store_gemv(acc, bias_ptr, out_ptr, rows, N, HAS_BIAS)


@triton.jit
def _gemv_kernel(
    in_ptr, weight_ptr, bias_ptr, out_ptr, stride_w, N,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    # GATED: the input is SiLU(in[:K]) * in[K:] (gate | up), each rounded as `silu_mul` rounds; else in[:K].
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x = tl.load(in_ptr + cols, mask=cols < K, other=0.0)
        if GATED:
            x = _silu_times_up(x, tl.load(in_ptr + K + cols, mask=cols < K, other=0.0)).to(x.dtype)
        acc += _weight_tile(weight_ptr, rows, cols, stride_w, N, K) * x.to(tl.float32)[None, :]
    _store_gemv(acc, bias_ptr, out_ptr, rows, N, HAS_BIAS)


@triton.jit
def _summed_input(x_ptr, residual_ptr, cols, HIDDEN: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """x (+ residual, rounded once to x's dtype) at cols; 0 past the row."""
    x = tl.load(x_ptr + cols, mask=cols < HIDDEN, other=0.0)
    if HAS_RESIDUAL:
        x = _rounded_sum(x, tl.load(residual_ptr + cols, mask=cols < HIDDEN, other=0.0))
    return x


@triton.jit
def _weight_tile(weight_ptr, rows, cols, stride_w, N, K: tl.constexpr):
    """weight[rows, cols] in fp32, 0 outside [N, K]."""
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    return tl.load(weight_ptr + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_gemv(acc, bias_ptr, out_ptr, rows, N, HAS_BIAS: tl.constexpr):
    """The tile's sums (+ bias), rounded once, as cuBLAS's epilogue rounds."""
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


def gemv_tiles(out_features: int, in_features: int, normed: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) for a one-token GEMV of a weight [N, K]; `normed`: `_norm_gemv_kernel`.

    Picked from a sweep of tile settings at the 0.6B's and the 8B's shapes (`sparkwire bench
    gpu-kernels gemv` times each): the norm kernel sums the row's squares once per program, so it
    takes 16 rows over 256 columns; the plain and gated GEMV 8 rows over 512 columns, or over 1024
    with 8 warps where 8-row programs would not fill the card twice (the 0.6B's 1024 rows, 128
    programs).
    """
    if normed:
        tiles = (16, 256, 4)
    else:
        tiles = (8, 1024, 8) if out_features < 2048 else (8, 512, 4)
    return tiles[0], min(tiles[1], triton.next_power_of_2(in_features)), tiles[2]


def norm_gemv_triton(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None, tiles: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [1, H]; weight [N, H] (rows contiguous) -> (linear(weight * rms_norm(x + residual)), x + residual)."""
    hidden = _check_gemv(x, weight, x.shape[1])
    out_features = weight.shape[0]
    out = torch.empty(1, out_features, dtype=x.dtype, device=x.device)
    summed = x if residual is None else torch.empty_like(x)
    block_n, block_k, warps = tiles or gemv_tiles(out_features, hidden, normed=True)
    _norm_gemv_kernel[(triton.cdiv(out_features, block_n),)](
        x, x if residual is None else residual, norm_weight, weight, weight if bias is None else bias, out, summed, eps,
        weight.stride(0), out_features, HIDDEN=hidden, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, num_warps=warps,
    )  # fmt: skip
    return out, summed


def silu_gemv_triton(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """gate_up [1, 2I] = [gate | up]; weight [N, I] (rows contiguous) -> linear(SiLU(gate) * up) [1, N]."""
    return _gemv(gate_up, weight, bias, tiles, gated=True)


def gemv_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """x [1, K]; weight [N, K] (rows contiguous) -> linear(x) [1, N]: one launch where cuBLAS takes one
    or two slower ones at these shapes."""
    return _gemv(x, weight, bias, tiles, gated=False)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: tuple[int, int, int] | None,
          gated: bool) -> torch.Tensor:  # fmt: skip
    in_features = _check_gemv(x, weight, x.shape[1] // 2 if gated else x.shape[1])
    out_features = weight.shape[0]
    out = torch.empty(1, out_features, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = tiles or gemv_tiles(out_features, in_features, normed=False)
    _gemv_kernel[(triton.cdiv(out_features, block_n),)](
        x, weight, weight if bias is None else bias, out, weight.stride(0), out_features,
        K=in_features, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, HAS_BIAS=bias is not None, num_warps=warps,
    )  # fmt: skip
    return out


def _check_gemv(x: torch.Tensor, weight: torch.Tensor, in_features: int) -> int:
    """in_features, after checking the one-token GEMV's layout: x one contiguous row, weight [N, in_features]."""
    if x.shape[0] != 1:
        raise ValueError(f"the one-token GEMV kernels take one row, not {x.shape[0]}")
    assert x.stride(-1) == 1 and weight.stride(1) == 1 and weight.shape[1] == in_features, "rows must be contiguous"
    return in_features

