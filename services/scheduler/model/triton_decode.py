"""Triton paged attention for short queries: one program per (sequence, kv head); a sequence has
1 query token (decode) or q (a speculative verify block, causal inside it).

Imported lazily and only on CUDA (the CPU image has no Triton). The program loads every query row
of its kv head (q tokens x the GQA group), walks the sequence's block table one cache block at a
time up to `seq_len`, and keeps an online softmax in fp32, so nothing is padded to the longest
sequence and no host sync is needed (the kernel is CUDA-graph safe). Reference semantics, tested
against this kernel on the GPU: `attention.paged_decode_attention_torch`. (An earlier kernel with
one program per query token was slower at every measured shape, ops/bench/results/gpu_core.md.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_block_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, seq_lens_ptr, tables_ptr, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
    GROUP: tl.constexpr, QUERY_LEN: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per (sequence, kv head) for all QUERY_LEN x GROUP query rows (row r = j * GROUP + g:
    # token j of the block, query head g of the kv head): each K/V block is read once for the whole
    # verify block, and both products run on the tensor cores (tl.dot needs ROWS >= 16).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    r = tl.arange(0, ROWS)
    j = r // GROUP
    row_ok = r < QUERY_LEN * GROUP
    token = seq * QUERY_LEN + j
    head = kv_head * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)  # [R, D]
    row_len = seq_len - (QUERY_LEN - 1 - j)  # keys row r sees: causal inside the block; >= 1
    m = tl.full([ROWS], float("-inf"), tl.float32)
    den = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for i in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * stride_tb + i).to(tl.int64)
        key_pos = i * BLOCK_SIZE + s  # [S]
        kv_offs = block * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=(key_pos < seq_len)[:, None], other=0.0)  # [S, D]
        v = tl.load(v_ptr + kv_offs, mask=(key_pos < seq_len)[:, None], other=0.0)  # [S, D]
        scores = tl.dot(q, tl.trans(k)) * scale  # [R, S], fp32 accumulation
        scores = tl.where(key_pos[None, :] < row_len[:, None], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # block 0 always has key 0 visible: finite from then on
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])  # [R, S]
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / den[:, None]
    o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_block_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    query_len: int = 1,
) -> torch.Tensor:
    """query [B * query_len, Hq, D]; caches [N, block_size, Hkv, D]; seq_lens int32 [B] (>= query_len);
    tables int32 [B, M]. Token t belongs to sequence t // query_len (see DecodePlan)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    query = query.contiguous() if query.stride(-1) != 1 else query
    out = torch.empty_like(query)
    rows = tile_rows(query_len, group)
    _paged_block_kernel[(num_tokens // query_len, num_kv_heads)](
        query, key_cache, value_cache, out, seq_lens, block_tables, scale,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, QUERY_LEN=query_len, ROWS=rows, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, num_warps=4,
    )
    return out


def tile_rows(tokens: int, group: int) -> int:
    """Rows of one program: `tokens` query tokens x the GQA group, a power of two >= 16 (tl.dot's
    minimum); the decode and the varlen kernels lay their programs out alike."""
    return max(16, triton.next_power_of_2(tokens * group))
