"""Triton causal flash attention over the paged KV cache for ragged steps: prefill chunks, mixed
prefill + decode batches, speculative verify blocks of per-request lengths.

One program per (query tile, kv head). A tile is up to BLOCK_M consecutive query tokens of one
sequence (the host-built tile map, `attention.VarlenPlan.tiles`, says which); the program loads
all of them for every query head of its kv head (rows r = token * GROUP + head in the group), so
each K/V page is read once for the whole group and both products run on the tensor cores. It walks
the sequence's block table BLOCK_N keys at a time, with an online softmax in fp32, up to the
tile's causal limit: keys below the tile's first position are visible to every row and need no
mask; only the last few iterations (the diagonal) mask key > row position. Query token i of
sequence b (q_len = query_start_loc[b + 1] - query_start_loc[b]) sits at position
seq_lens[b] - q_len + i. No host sync; the grid is the tile count, which the host knows.

Sliding windows and soft-capping (WINDOW, SOFTCAP constexprs, 0 for none): a row at position p sees
keys p - WINDOW + 1 .. p, so a tile starts at the block of its first row's window start and every
iteration masks both ends (a row may then see none of a block); soft-capping applies to the scores
in base 2 with the cap scaled alike (cap * tanh(s / cap) * log2 e = c2 * tanh(s2 / c2), c2 = cap * log2 e).

Imported lazily and only where Triton is (CUDA; the CPU interpreter in tests, TRITON_INTERPRET=1).
Reference semantics: `attention.varlen_attention_torch` (small shapes) and the ragged SDPA groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.scheduler.model.triton_decode import tanh, tile_rows

LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int = 64  # keys per iteration (several cache pages)
    num_warps: int = 4
    num_stages: int = 2


def default_launch_config(rows: int) -> LaunchConfig:
    # Untuned first guess (FlashAttention-2 Triton settings for d 128 at 128 rows); `sparkwire bench
    # gpu-kernels attention` sweeps alternatives (its "sweep" section).
    if rows >= 128:
        return LaunchConfig(block_n=64, num_warps=8, num_stages=3)
    return LaunchConfig(block_n=64, num_warps=4, num_stages=2)


@triton.jit
def _attend_keys(
    q, m, den, acc, start, row_pos, last_pos, seq, kv_head, k_ptr, v_ptr, tables_ptr, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_tb,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP2: tl.constexpr,
):
    # One online-softmax update with keys start .. start + BLOCK_N - 1, in base 2 (qk_scale carries log2 e,
    # SOFTCAP2 the cap times log2 e).
    key = start + tl.arange(0, BLOCK_N)  # [N]
    d = tl.arange(0, HEAD_DIM)
    page_ptrs = tables_ptr + seq * stride_tb + key // PAGE_SIZE
    if MASKED:  # the diagonal: keys past the tile's last position are neither read nor seen
        key_ok = key <= last_pos
        page = tl.load(page_ptrs, mask=key_ok, other=0).to(tl.int64)
    else:
        page = tl.load(page_ptrs).to(tl.int64)
    kv_offs = page[:, None] * stride_kb + (key % PAGE_SIZE)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
    if MASKED:
        k = tl.load(k_ptr + kv_offs, mask=key_ok[:, None], other=0.0)  # [N, D]
        v = tl.load(v_ptr + kv_offs, mask=key_ok[:, None], other=0.0)  # [N, D]
    else:
        k = tl.load(k_ptr + kv_offs)
        v = tl.load(v_ptr + kv_offs)
    scores = tl.dot(q, tl.trans(k)) * qk_scale  # [R, N], fp32 accumulation
    if SOFTCAP2 > 0:
        scores = SOFTCAP2 * tanh(scores / SOFTCAP2)
    if MASKED:
        seen = key[None, :] <= row_pos[:, None]  # [R, N]
        if WINDOW > 0:
            seen = seen & (key[None, :] > row_pos[:, None] - WINDOW)
        scores = tl.where(seen, scores, float("-inf"))
    # Finite from the first iteration on: key 0 is in it and every row sees key 0. A later row
    # with every key of a diagonal block masked keeps m (alpha 1, p 0). With a window a row may
    # have seen no key yet: its m stays -inf and is measured from 0 (exp2(-inf) = 0, never -inf + inf).
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    if WINDOW > 0:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.math.exp2(m - m_ref)
    p = tl.math.exp2(scores - m_ref[:, None])  # [R, N]
    den = den * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, den, acc


@triton.jit
def _varlen_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, query_start_ptr, seq_lens_ptr, tables_ptr, tiles_ptr, num_tiles, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP2: tl.constexpr,
    INVARIANT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile)
    first = tl.load(tiles_ptr + num_tiles + tile)  # the tile's first query index within its sequence
    token0 = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - token0
    context = tl.load(seq_lens_ptr + seq) - q_len  # keys before the sequence's first new token
    r = tl.arange(0, ROWS)
    index = first + r // GROUP  # query index of row r
    row_ok = (r < BLOCK_M * GROUP) & (index < q_len)
    head = kv_head * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)
    q_offs = (token0 + index)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)  # [R, D]
    last_pos = context + tl.minimum(first + BLOCK_M, q_len) - 1  # the tile's causal limit
    row_pos = tl.minimum(context + index, last_pos)  # padded rows act as the last real one; never stored
    m = tl.full([ROWS], float("-inf"), tl.float32)
    den = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    if WINDOW > 0:  # from the block of the first row's window start, both ends masked
        unmasked_end = tl.maximum(context + first - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    elif INVARIANT:  # every block on the masked path: a row's arithmetic never depends on its tile
        unmasked_end = 0
    else:
        unmasked_end = (context + first + 1) // BLOCK_N * BLOCK_N  # keys below it: visible to every row
        for start in range(0, unmasked_end, BLOCK_N):
            m, den, acc = _attend_keys(
                q, m, den, acc, start, row_pos, last_pos, seq, kv_head, k_ptr, v_ptr, tables_ptr, qk_scale,
                stride_kb, stride_ks, stride_kh, stride_tb, HEAD_DIM, PAGE_SIZE, BLOCK_N, False, WINDOW, SOFTCAP2,
            )
    for start in range(unmasked_end, last_pos + 1, BLOCK_N):
        m, den, acc = _attend_keys(
            q, m, den, acc, start, row_pos, last_pos, seq, kv_head, k_ptr, v_ptr, tables_ptr, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_tb, HEAD_DIM, PAGE_SIZE, BLOCK_N, True, WINDOW, SOFTCAP2,
        )
    out = acc / den[:, None]
    o_offs = (token0 + index)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def varlen_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    tiles: torch.Tensor,
    block_m: int,
    scale: float,
    config: LaunchConfig | None = None,
    window: int = 0,
    softcap: float = 0.0,
    invariant: bool = False,
) -> torch.Tensor:
    """query [T, Hq, D]; caches [N, page_size, Hkv, D] (new K/V already written); query_start_loc
    int32 [B + 1]; seq_lens int32 [B]; block_tables int32 [B, M]; tiles int32 [2, num_tiles]
    (sequence, first query index) of `block_m`-token tiles covering every query -> [T, Hq, D].
    window, softcap: as `attention.paged_attention` (0: none)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, page_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    query = query.contiguous() if query.stride(-1) != 1 else query
    out = torch.empty_like(query)
    rows = tile_rows(block_m, group)
    config = config or default_launch_config(rows)  # rows fixed by block_m: invariant plans fix that
    num_tiles = tiles.shape[1]
    if num_tiles == 0:
        return out
    _varlen_kernel[(num_tiles, num_kv_heads)](
        query, key_cache, value_cache, out, query_start_loc, seq_lens, block_tables, tiles, num_tiles, scale * LOG2_E,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, BLOCK_M=block_m, ROWS=rows, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_N=config.block_n,
        WINDOW=window, SOFTCAP2=float(softcap) * LOG2_E, INVARIANT=invariant,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
