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

The deterministic mode (`invariant`, KV_SPLIT > 0) masks every block and splits the keys by size:
keys 0 .. KV_SPLIT - 1, the next KV_SPLIT, ..., each split an online softmax from nothing, merged
in split order (`_merge`), so a row's arithmetic follows its position alone, never its tile or the
step. A tile's splits run in one program (`_varlen_kernel` walks and merges them) or, where the
step leaves SMs idle (`kv_splits.invariant_kv_splits`), one program each (`_varlen_split_kernel`,
fp32 partials) and a merge kernel (`_varlen_merge_kernel`) that merges them in the same order:
the same bits either way. Splits (or blocks) a row does not reach leave it as it was (m -inf: weight 0).

Imported lazily and only where Triton is (CUDA; the CPU interpreter in tests, TRITON_INTERPRET=1).
Reference semantics: `attention.varlen_attention_torch` (small shapes) and the ragged SDPA groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.scheduler.model.kv_splits import KV_SPLIT_TOKENS
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
    WINDOW: tl.constexpr, SOFTCAP2: tl.constexpr, KV_SPLIT: tl.constexpr,
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
    # with every key of a diagonal block masked keeps m (alpha 1, p 0). With a window, or in a key
    # split past key 0, a row may have seen no key yet: its m stays -inf and is measured from 0
    # (exp2(-inf) = 0, never -inf + inf).
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    if WINDOW > 0 or KV_SPLIT > 0:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.math.exp2(m - m_ref)
    p = tl.math.exp2(scores - m_ref[:, None])  # [R, N]
    den = den * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, den, acc


@triton.jit
def _tile_rows(query_start_ptr, seq_lens_ptr, tiles_ptr, num_tiles, tile, kv_head,
               GROUP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
    # The tile's rows r = token * GROUP + head in the group: (sequence, first query index, keys before
    # the sequence's first new token, each row's flat token [R], query head [R], whether it is real [R],
    # position [R], and the tile's causal limit).
    seq = tl.load(tiles_ptr + tile)
    first = tl.load(tiles_ptr + num_tiles + tile)  # the tile's first query index within its sequence
    token0 = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - token0
    context = tl.load(seq_lens_ptr + seq) - q_len
    r = tl.arange(0, ROWS)
    index = first + r // GROUP  # query index of row r
    row_ok = (r < BLOCK_M * GROUP) & (index < q_len)
    last_pos = context + tl.minimum(first + BLOCK_M, q_len) - 1
    row_pos = tl.minimum(context + index, last_pos)  # padded rows act as the last real one; never stored
    return seq, first, context, token0 + index, kv_head * GROUP + r % GROUP, row_ok, row_pos, last_pos


@triton.jit
def _first_split(context, first, WINDOW: tl.constexpr, KV_SPLIT: tl.constexpr):
    # The first key split any row of the tile sees: 0, or the split of the first row's window start.
    start = context * 0
    if WINDOW > 0:
        start = tl.maximum(context + first - WINDOW + 1, 0) // KV_SPLIT * KV_SPLIT
    return start


@triton.jit
def _attend_split(
    q, split_start, row_pos, last_pos, seq, kv_head, k_ptr, v_ptr, tables_ptr, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_tb,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP2: tl.constexpr, KV_SPLIT: tl.constexpr,
):
    # One key split's partial, from nothing: (row max [R], sum of exp2 [R], unnormalized output [R, D]), fp32.
    m = tl.full([ROWS], float("-inf"), tl.float32)
    den = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for start in range(split_start, tl.minimum(split_start + KV_SPLIT, last_pos + 1), BLOCK_N):
        m, den, acc = _attend_keys(
            q, m, den, acc, start, row_pos, last_pos, seq, kv_head, k_ptr, v_ptr, tables_ptr, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_tb, HEAD_DIM, PAGE_SIZE, BLOCK_N, True, WINDOW, SOFTCAP2, KV_SPLIT,
        )
    return m, den, acc


@triton.jit
def _merge(m, den, acc, m_s, den_s, acc_s):
    # The running partial and the next split's, log-sum-exp style in base 2; an empty side (m -inf) weighs 0.
    m_new = tl.maximum(m, m_s)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_ref)
    beta = tl.math.exp2(m_s - m_ref)
    return m_new, den * alpha + den_s * beta, acc * alpha[:, None] + acc_s * beta[:, None]


@triton.jit
def _varlen_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, query_start_ptr, seq_lens_ptr, tables_ptr, tiles_ptr, num_tiles, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP2: tl.constexpr,
    KV_SPLIT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq, first, context, token, head, row_ok, row_pos, last_pos = _tile_rows(
        query_start_ptr, seq_lens_ptr, tiles_ptr, num_tiles, tile, kv_head, GROUP, BLOCK_M, ROWS)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    den = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    if KV_SPLIT > 0:  # invariant: the split kernels' splits, walked and merged here in the same order
        for split_start in range(_first_split(context, first, WINDOW, KV_SPLIT), last_pos + 1, KV_SPLIT):
            m_s, den_s, acc_s = _attend_split(
                q, split_start, row_pos, last_pos, seq, kv_head, k_ptr, v_ptr, tables_ptr, qk_scale,
                stride_kb, stride_ks, stride_kh, stride_tb, ROWS, HEAD_DIM, PAGE_SIZE, BLOCK_N, WINDOW, SOFTCAP2, KV_SPLIT,
            )
            m, den, acc = _merge(m, den, acc, m_s, den_s, acc_s)
    else:
        if WINDOW > 0:  # from the block of the first row's window start, both ends masked
            unmasked_end = tl.maximum(context + first - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        else:
            unmasked_end = (context + first + 1) // BLOCK_N * BLOCK_N  # keys below it: visible to every row
            for start in range(0, unmasked_end, BLOCK_N):
                m, den, acc = _attend_keys(
                    q, m, den, acc, start, row_pos, last_pos, seq, kv_head, k_ptr, v_ptr, tables_ptr, qk_scale,
                    stride_kb, stride_ks, stride_kh, stride_tb, HEAD_DIM, PAGE_SIZE, BLOCK_N, False, WINDOW, SOFTCAP2, 0,
                )
        for start in range(unmasked_end, last_pos + 1, BLOCK_N):
            m, den, acc = _attend_keys(
                q, m, den, acc, start, row_pos, last_pos, seq, kv_head, k_ptr, v_ptr, tables_ptr, qk_scale,
                stride_kb, stride_ks, stride_kh, stride_tb, HEAD_DIM, PAGE_SIZE, BLOCK_N, True, WINDOW, SOFTCAP2, 0,
            )
    out = acc / den[:, None]
    o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _varlen_split_kernel(
    q_ptr, k_ptr, v_ptr, max_ptr, sum_ptr, acc_ptr, query_start_ptr, seq_lens_ptr, tables_ptr, tiles_ptr, num_tiles,
    num_heads, num_splits, qk_scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP2: tl.constexpr,
    KV_SPLIT: tl.constexpr,
):
    # One program per (tile, kv head, split): the partial of keys split * KV_SPLIT .. + KV_SPLIT - 1,
    # laid out [T, Hq, num_splits] (and [T, Hq, num_splits, D]), fp32; splits the tile does not
    # reach store nothing (the merge kernel reads none of them).
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, first, context, token, head, row_ok, row_pos, last_pos = _tile_rows(
        query_start_ptr, seq_lens_ptr, tiles_ptr, num_tiles, tile, kv_head, GROUP, BLOCK_M, ROWS)
    split_start = split * KV_SPLIT
    if (split_start >= _first_split(context, first, WINDOW, KV_SPLIT)) & (split_start <= last_pos):
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        m, den, acc = _attend_split(
            q, split_start, row_pos, last_pos, seq, kv_head, k_ptr, v_ptr, tables_ptr, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_tb, ROWS, HEAD_DIM, PAGE_SIZE, BLOCK_N, WINDOW, SOFTCAP2, KV_SPLIT,
        )
        part = (token.to(tl.int64) * num_heads + head) * num_splits + split  # [R]
        tl.store(max_ptr + part, m, mask=row_ok)
        tl.store(sum_ptr + part, den, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _varlen_merge_kernel(
    max_ptr, sum_ptr, acc_ptr, out_ptr, query_start_ptr, seq_lens_ptr, tiles_ptr, num_tiles, num_heads, num_splits,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr,
    KV_SPLIT: tl.constexpr,
):
    # One program per (tile, kv head): the split kernel's partials of its rows, merged in split order
    # as `_varlen_kernel` merges them in registers: the same bits.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq, first, context, token, head, row_ok, row_pos, last_pos = _tile_rows(
        query_start_ptr, seq_lens_ptr, tiles_ptr, num_tiles, tile, kv_head, GROUP, BLOCK_M, ROWS)
    d = tl.arange(0, HEAD_DIM)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    den = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for split_start in range(_first_split(context, first, WINDOW, KV_SPLIT), last_pos + 1, KV_SPLIT):
        part = (token.to(tl.int64) * num_heads + head) * num_splits + split_start // KV_SPLIT  # [R]
        m_s = tl.load(max_ptr + part, mask=row_ok, other=float("-inf"))
        den_s = tl.load(sum_ptr + part, mask=row_ok, other=0.0)
        acc_s = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)
        m, den, acc = _merge(m, den, acc, m_s, den_s, acc_s)
    out = acc / den[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip


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
    kv_splits: int = 1,
) -> torch.Tensor:
    """query [T, Hq, D]; caches [N, page_size, Hkv, D] (new K/V already written); query_start_loc
    int32 [B + 1]; seq_lens int32 [B]; block_tables int32 [B, M]; tiles int32 [2, num_tiles]
    (sequence, first query index) of `block_m`-token tiles covering every query -> [T, Hq, D].
    window, softcap: as `attention.paged_attention` (0: none). invariant: keys in `KV_SPLIT_TOKENS`
    splits merged in order; kv_splits > 1 (invariant only): that many programs per tile along the
    keys, enough for the longest sequence (`kv_splits.invariant_kv_splits`), then a merge kernel."""
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
    split = KV_SPLIT_TOKENS if invariant else 0
    if split % config.block_n:
        raise ValueError(f"block_n {config.block_n} must divide the key split ({split} keys)")
    shape = {"GROUP": group, "BLOCK_M": block_m, "ROWS": rows, "HEAD_DIM": head_dim}
    keys = {"PAGE_SIZE": page_size, "BLOCK_N": config.block_n, "WINDOW": window, "SOFTCAP2": float(softcap) * LOG2_E,
            "KV_SPLIT": split, "num_warps": config.num_warps, "num_stages": config.num_stages}  # fmt: skip
    if invariant:  # one rounding per operation: a merge rounds alike in registers and from the partials
        keys["enable_fp_fusion"] = False
    lengths = (query_start_loc, seq_lens, block_tables, tiles, num_tiles)
    cache_strides = (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0))
    if not invariant or kv_splits == 1:
        _varlen_kernel[(num_tiles, num_kv_heads)](
            query, key_cache, value_cache, out, *lengths, scale * LOG2_E, query.stride(0), query.stride(1),
            *cache_strides[:3], out.stride(0), out.stride(1), block_tables.stride(0), **shape, **keys,
        )  # fmt: skip
        return out
    partial_max = torch.empty(query.shape[0], num_heads, kv_splits, dtype=torch.float32, device=query.device)  # [T, Hq, S]
    partial_sum = torch.empty_like(partial_max)
    partial_out = torch.empty(*partial_max.shape, head_dim, dtype=torch.float32, device=query.device)  # [T, Hq, S, D]
    _varlen_split_kernel[(num_tiles, num_kv_heads, kv_splits)](
        query, key_cache, value_cache, partial_max, partial_sum, partial_out, *lengths, num_heads, kv_splits,
        scale * LOG2_E, query.stride(0), query.stride(1), *cache_strides, **shape, **keys,
    )  # fmt: skip
    _varlen_merge_kernel[(num_tiles, num_kv_heads)](
        partial_max, partial_sum, partial_out, out, query_start_loc, seq_lens, tiles, num_tiles, num_heads, kv_splits,
        out.stride(0), out.stride(1), **shape, WINDOW=window, KV_SPLIT=split, num_warps=config.num_warps, enable_fp_fusion=False,
    )  # fmt: skip
    return out
