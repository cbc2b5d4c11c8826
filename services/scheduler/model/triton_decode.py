"""Triton paged attention for short queries: one program per (sequence, kv head), or per (sequence,
kv head, key split); a sequence has 1 query token (decode) or q (a speculative verify block,
causal inside it).

Imported lazily and only on CUDA (the CPU image has no Triton). A program loads every query row
of its kv head (q tokens x the GQA group), walks the sequence's block table one cache block at a
time up to `seq_len`, and keeps an online softmax in fp32, so nothing is padded to the longest
sequence and no host sync is needed (the kernel is CUDA-graph safe). Reference semantics, tested
against this kernel on the GPU: `attention.paged_decode_attention_torch`. (An earlier kernel with
one program per query token was slower at every measured shape.)

Split-KV ("flash-decoding"): at batch 1 the grid above is num_kv_heads programs (8 on 132 SMs).
With `num_splits` S > 1 each (sequence, kv head) is cut into S runs of its own blocks, one program
each, writing fp32 partials (row max m_s, sum of exp l_s, unnormalized output o_s); a second
kernel combines them: m = max_s m_s, out = sum_s exp(m_s - m) o_s / sum_s exp(m_s - m) l_s. S is
chosen on the host from shapes alone, once per plan (`kv_splits.num_kv_splits`, `DecodePlan`), so
a graph captured for a rung keeps it; the split length comes from each sequence's own seq_len on
the device, and splits past its last block, or past a verify row's last key, leave m_s = -inf,
which the combine weighs 0.

Sliding windows and soft-capping (WINDOW, SOFTCAP: constexprs, 0 for none) follow the twin: a row
at position p sees keys p - WINDOW + 1 .. p, so a sequence's programs start at the block holding its
first row's window start (the split kernel splits the blocks from there on), and rows may see no
key of a block; scores s become SOFTCAP * tanh(s / SOFTCAP) before the online softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.scheduler.model.kv_splits import MAX_SPLITS


@triton.jit
def _query_rows(q_ptr, seq, kv_head, seq_len, stride_qt, stride_qh,
                GROUP: tl.constexpr, QUERY_LEN: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    # Row r = j * GROUP + g: token j of the block, query head g of the kv head, so each K/V block is
    # read once for the whole verify block, and both products run on the tensor cores (tl.dot needs
    # ROWS >= 16). Returns q [R, D], each row's token and head [R], whether it is real [R], and the
    # keys it sees [R] (causal inside the block; >= 1).
    r = tl.arange(0, ROWS)
    j = r // GROUP
    row_ok = r < QUERY_LEN * GROUP
    token = seq * QUERY_LEN + j
    head = kv_head * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)  # [R, D]
    row_len = seq_len - (QUERY_LEN - 1 - j)
    return q, token, head, row_ok, row_len


@triton.jit
def tanh(x):
    """tanh from one exp, sign-symmetric (no overflow for any |x|)."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _first_block(seq_len, QUERY_LEN: tl.constexpr, BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    # The block holding the first row's first visible key: 0 without a window.
    first = seq_len * 0
    if WINDOW > 0:
        first = tl.maximum(seq_len - QUERY_LEN + 1 - WINDOW, 0) // BLOCK_SIZE
    return first


@triton.jit
def _attend_blocks(q, k_ptr, v_ptr, tables_ptr, seq, kv_head, seq_len, row_len, first_block, end_block, scale,
                   stride_kb, stride_ks, stride_kh, stride_tb,
                   ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS_MAY_SEE_NONE: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    # Online softmax of q's rows over table blocks first_block .. end_block - 1: (row max [R], sum of
    # exp [R], unnormalized output [R, D]), fp32. ROWS_MAY_SEE_NONE: a run that need not hold key 0,
    # where a row can see no key (it keeps m = -inf, sums 0); else block 0 makes m finite at once.
    # A window lets a row see none of a block too.
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    den = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for i in range(first_block, end_block):
        block = tl.load(tables_ptr + seq * stride_tb + i).to(tl.int64)
        key_pos = i * BLOCK_SIZE + s  # [S]
        kv_offs = block * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=(key_pos < seq_len)[:, None], other=0.0)  # [S, D]
        v = tl.load(v_ptr + kv_offs, mask=(key_pos < seq_len)[:, None], other=0.0)  # [S, D]
        scores = tl.dot(q, tl.trans(k)) * scale  # [R, S], fp32 accumulation
        if SOFTCAP > 0:
            scores = SOFTCAP * tanh(scores / SOFTCAP)
        seen = key_pos[None, :] < row_len[:, None]  # [R, S]
        if WINDOW > 0:
            seen = seen & (key_pos[None, :] >= row_len[:, None] - WINDOW)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        if ROWS_MAY_SEE_NONE or WINDOW > 0:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp(-inf - 0) = 0, not exp(-inf + inf)
        else:
            m_ref = m_new
        alpha = tl.exp(m - m_ref)
        p = tl.exp(scores - m_ref[:, None])  # [R, S]
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return m, den, acc


@triton.jit
def _paged_block_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, seq_lens_ptr, tables_ptr, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
    GROUP: tl.constexpr, QUERY_LEN: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # One program per (sequence, kv head) for all QUERY_LEN x GROUP query rows, every block of the sequence.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    q, token, head, row_ok, row_len = _query_rows(q_ptr, seq, kv_head, seq_len, stride_qt, stride_qh,
                                                  GROUP, QUERY_LEN, ROWS, HEAD_DIM)  # fmt: skip
    first_block = _first_block(seq_len, QUERY_LEN, BLOCK_SIZE, WINDOW)
    m, den, acc = _attend_blocks(q, k_ptr, v_ptr, tables_ptr, seq, kv_head, seq_len, row_len,
                                 first_block, tl.cdiv(seq_len, BLOCK_SIZE), scale, stride_kb, stride_ks, stride_kh,
                                 stride_tb, ROWS, HEAD_DIM, BLOCK_SIZE, False, WINDOW, SOFTCAP)  # fmt: skip
    out = acc / den[:, None]
    d = tl.arange(0, HEAD_DIM)
    o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _paged_split_kernel(
    q_ptr, k_ptr, v_ptr, max_ptr, sum_ptr, acc_ptr, seq_lens_ptr, tables_ptr, scale, num_heads, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
    GROUP: tl.constexpr, QUERY_LEN: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # One program per (sequence, kv head, split): split s reads blocks lo + s * per_split .. of the
    # sequence's blocks lo .. cdiv(seq_len, BLOCK_SIZE) - 1 (lo: 0, or the window's first),
    # per_split = cdiv(their count, num_splits) (none past the last); partials are laid out
    # [T, Hq, num_splits] (and [T, Hq, num_splits, D]), fp32.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    lo = _first_block(seq_len, QUERY_LEN, BLOCK_SIZE, WINDOW)
    per_split = tl.cdiv(num_blocks - lo, num_splits)
    first_block = lo + split * per_split
    end_block = tl.minimum(first_block + per_split, num_blocks)
    q, token, head, row_ok, row_len = _query_rows(q_ptr, seq, kv_head, seq_len, stride_qt, stride_qh,
                                                  GROUP, QUERY_LEN, ROWS, HEAD_DIM)  # fmt: skip
    m, den, acc = _attend_blocks(q, k_ptr, v_ptr, tables_ptr, seq, kv_head, seq_len, row_len,
                                 first_block, end_block, scale, stride_kb, stride_ks, stride_kh, stride_tb,
                                 ROWS, HEAD_DIM, BLOCK_SIZE, True, WINDOW, SOFTCAP)  # fmt: skip
    part = (token * num_heads + head) * num_splits + split  # [R]
    tl.store(max_ptr + part, m, mask=row_ok)
    tl.store(sum_ptr + part, den, mask=row_ok)
    d = tl.arange(0, HEAD_DIM)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _combine_splits_kernel(
    max_ptr, sum_ptr, acc_ptr, out_ptr, num_heads, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
):
    # One program per (query token, query head): the log-sum-exp merge of its num_splits partials.
    # Some split holds the row's own key, which it sees, so the max is finite; empty splits weigh 0.
    token = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    split_ok = sp < num_splits
    part = (token * num_heads + head) * num_splits + sp  # [SPLITS]
    m = tl.load(max_ptr + part, mask=split_ok, other=float("-inf"))  # [SPLITS]
    den = tl.load(sum_ptr + part, mask=split_ok, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=split_ok[:, None], other=0.0)  # [SPLITS, D]
    weight = tl.exp(m - tl.max(m, axis=0))  # [SPLITS]
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(den * weight, axis=0)  # [D]
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def paged_block_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    query_len: int = 1,
    num_splits: int = 1,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """query [B * query_len, Hq, D]; caches [N, block_size, Hkv, D]; seq_lens int32 [B] (>= query_len);
    tables int32 [B, M]. Token t belongs to sequence t // query_len (see DecodePlan). num_splits 1:
    one program per (sequence, kv head); more (up to MAX_SPLITS): split-KV, the count
    `kv_splits.num_kv_splits` picks. window, softcap: as `attention.paged_attention` (0: none)."""
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    query = query.contiguous() if query.stride(-1) != 1 else query
    out = torch.empty_like(query)
    shape = {"GROUP": group, "QUERY_LEN": query_len, "ROWS": tile_rows(query_len, group), "HEAD_DIM": head_dim,
             "BLOCK_SIZE": block_size, "WINDOW": window, "SOFTCAP": float(softcap)}
    cache_strides = (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))
    grid = (num_tokens // query_len, num_kv_heads)
    if num_splits == 1:
        _paged_block_kernel[grid](
            query, key_cache, value_cache, out, seq_lens, block_tables, scale, query.stride(0), query.stride(1),
            *cache_strides, out.stride(0), out.stride(1), block_tables.stride(0), **shape, num_warps=4,
        )  # fmt: skip
        return out
    partial_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)  # [T, Hq, S]
    partial_sum = torch.empty_like(partial_max)  # [T, Hq, S]
    partial_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    _paged_split_kernel[(*grid, num_splits)](
        query, key_cache, value_cache, partial_max, partial_sum, partial_out, seq_lens, block_tables, scale,
        num_heads, num_splits, query.stride(0), query.stride(1), *cache_strides, block_tables.stride(0),
        **shape, num_warps=4,
    )  # fmt: skip
    _combine_splits_kernel[(num_tokens, num_heads)](
        partial_max, partial_sum, partial_out, out, num_heads, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS=triton.next_power_of_2(num_splits), num_warps=4,
    )  # fmt: skip
    return out


def tile_rows(tokens: int, group: int) -> int:
    """Rows of one program: `tokens` query tokens x the GQA group, a power of two >= 16 (tl.dot's
    minimum); the decode and the varlen kernels lay their programs out alike."""
    return max(16, triton.next_power_of_2(tokens * group))
