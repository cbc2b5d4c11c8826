"""Paged causal attention over a ragged batch, with torch SDPA.

Each step's sequences are split into groups once (`plan_attention`), and every layer reuses the
plan. Short queries (decode, speculative verify) share one padded, batched SDPA call; each long
query (a prefill chunk) gets its own call, so padding never multiplies a long prefill. The causal
rule is by position: a query at position p sees cached keys 0..p of its own sequence.

Steps whose sequences all have the same short query of q tokens (decode, q = 1; speculative
verify, q = k + 1) can instead take a `DecodePlan`: no host sync, static shapes, so they can be
captured in a CUDA graph. On CUDA its attention is a Triton paged kernel (`triton_decode.py`)
that walks each sequence's block table up to its own length; its CPU twin,
`paged_decode_attention_torch`, computes the same function by gathering every block of the table
and masking each query's keys past its own position.

On CUDA, ragged steps take a `VarlenPlan` instead of the SDPA groups: one Triton causal flash
kernel (`triton_varlen.py`) over the paged cache for every sequence of the step, whatever its
query length, launched over a tile map the host builds from the lengths it already has. Its torch
twin, `varlen_attention_torch`, is the same per-token gather as the decode twin (small shapes only).
A plan built with a `DenseConfig` leaves the step's long queries out of the tile map and attends
them over gathered K/V with FlashAttention-4 or torch SDPA (`dense_attention.py`: both are faster
there); a step that is one such sequence alone returns that call's output as its own.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.dense_attention import DenseConfig, DensePlan, attend_dense, attend_dense_sequence, plan_dense
from services.scheduler.model.kv_splits import invariant_kv_splits

MAX_BATCHED_QUERY_LEN = 16  # longer queries are prefill chunks, attended one sequence at a time


@dataclass(frozen=True)
class AttentionGroup:
    token_index: torch.Tensor  # int64 [G, max_q], flat token of each padded query (0 on padding)
    valid_rows: torch.Tensor  # int64 [N], rows of the flattened [G * max_q] padded queries that are real
    valid_tokens: torch.Tensor  # int64 [N], the flat token each of those rows belongs to
    blocks: torch.Tensor  # int64 [G, num_blocks], cache blocks to read (clamped to >= 0)
    mask: torch.Tensor | None  # bool [G, 1, max_q, num_blocks * block_size]; None: plain causal
    num_keys: int  # keys read per sequence: num_blocks * block_size, or seq_len when unmasked
    query_pos: torch.Tensor  # int64 [G, max_q], each padded query's position (0 on padding)


@dataclass(frozen=True)
class AttentionPlan:
    groups: tuple[AttentionGroup, ...]


@dataclass(frozen=True)
class DecodePlan:
    """`query_len` query tokens per sequence (1: decode; k + 1: a verify block), the last at
    position seq_len - 1, each seeing the keys up to its own position; every table entry a real
    block id. Token t belongs to sequence t // query_len."""

    seq_lens: torch.Tensor  # int32 [B], KV length of each sequence after this step
    block_tables: torch.Tensor  # int32 [B, M], entries past a sequence's blocks point at any valid block
    use_kernel: bool  # True: the Triton kernel (CUDA only); False: the torch twin
    query_len: int = 1
    num_kv_splits: int = 1  # kernel programs per (sequence, kv head); > 1: split-KV (`kv_splits.num_kv_splits`)


@dataclass(frozen=True)
class VarlenPlan:
    """A ragged step for the varlen kernel: `block_m`-token query tiles, each of one sequence,
    heaviest first (most keys to read), so the longest programs do not start last."""

    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B], KV length of each sequence after this step
    block_tables: torch.Tensor  # int32 [B, M]
    tiles: torch.Tensor  # int32 [2, num_tiles]: each tile's sequence, and its first query index in it
    block_m: int  # query tokens per tile
    use_kernel: bool  # True: the Triton kernel; False: the torch twin
    dense: DensePlan | None = None  # sequences attended by SDPA instead (no tiles); None: none
    invariant: bool = False  # a row's reduction order set by its position alone (`batch_invariant`)
    num_kv_splits: int = 1  # invariant: programs per tile along the keys (`kv_splits.invariant_kv_splits`)


MAX_TILE_ROWS = 128  # query rows (tokens x GQA group) per kernel program


def host_lengths(batch: ForwardBatch) -> tuple[list[int], list[int]]:
    """(query_start_loc [B + 1], seq_lens [B]) as host lists: read back from the device only when
    the batch does not carry them on the host."""
    if batch.host_query_lens is not None and batch.host_seq_lens is not None:
        return [0, *itertools.accumulate(batch.host_query_lens)], list(batch.host_seq_lens)
    return batch.query_start_loc.tolist(), batch.seq_lens.tolist()


def tile_tokens(max_query_len: int, group: int, max_rows: int = MAX_TILE_ROWS) -> int:
    """Query tokens per tile: enough for the longest query, at most `max_rows` rows of `group` heads."""
    longest = 1 << max(0, max_query_len - 1).bit_length()  # next power of two
    return max(1, min(max_rows // group, longest))


def query_tiles(query_lens: list[int], seq_lens: list[int], block_m: int) -> list[tuple[int, int]]:
    """(sequence, first query index) of every `block_m`-token tile, by keys read, most first."""
    tiles = [(b, first) for b, q_len in enumerate(query_lens) for first in range(0, q_len, block_m)]

    def keys_read(tile: tuple[int, int]) -> int:
        b, first = tile
        return seq_lens[b] - query_lens[b] + min(first + block_m, query_lens[b])

    return sorted(tiles, key=keys_read, reverse=True)


def plan_varlen(
    batch: ForwardBatch,
    group: int,
    use_kernel: bool = True,
    max_rows: int = MAX_TILE_ROWS,
    dense: DenseConfig | None = None,
    invariant: bool = False,
    split_sms: int = 0,
    num_kv_heads: int = 1,
) -> VarlenPlan:
    """The tile map of a ragged step, built on the host and uploaded once (no host sync when the
    batch carries its lengths on the host). group: query heads per kv head. dense: queries of at
    least `dense.min_query_len` tokens get no tiles and go through `dense_attention` instead.
    invariant: one tile size, no dense queries, keys split by size over the SMs (split_sms) the
    tiles' programs leave idle (`batch_invariant`, `kv_splits`)."""
    starts, seq_lens = host_lengths(batch)
    query_lens = [end - start for start, end in zip(starts, starts[1:])]
    query_lens, dense_plan = _split_dense(starts, seq_lens, query_lens, None if invariant else dense)
    block_m = tile_tokens(max_rows if invariant else max(query_lens, default=1), group, max_rows)
    device = batch.input_ids.device
    tiles = torch.tensor(query_tiles(query_lens, seq_lens, block_m), dtype=torch.int32).reshape(-1, 2).T.contiguous()
    if device.type == "cuda":
        tiles = tiles.pin_memory()
    tiles = tiles.to(device, non_blocking=True)  # [2, num_tiles]
    splits = invariant_kv_splits(tiles.shape[1], num_kv_heads, starts[-1], max(seq_lens, default=0), split_sms)
    return VarlenPlan(batch.query_start_loc, batch.seq_lens, batch.block_tables, tiles, block_m, use_kernel, dense_plan,
                      invariant, splits if invariant else 1)  # fmt: skip


def _split_dense(
    starts: list[int], seq_lens: list[int], query_lens: list[int], dense: DenseConfig | None
) -> tuple[list[int], DensePlan | None]:
    """(the query lengths the tile map covers, dense sequences' set to 0; the dense plan, None when
    no sequence is long enough)."""
    plan = plan_dense(starts, seq_lens, dense) if dense is not None else None
    if plan is None or not plan.sequences:
        return query_lens, None
    taken = {s.seq for s in plan.sequences}
    return [0 if b in taken else n for b, n in enumerate(query_lens)], plan


def plan_attention(batch: ForwardBatch, block_size: int) -> AttentionPlan:
    """Group the batch's sequences for attention (lengths read back from the device only when the
    batch does not carry them on the host)."""
    starts, seq_lens = host_lengths(batch)
    buckets: dict[tuple[int, int], list[int]] = {}
    for b, seq_len in enumerate(seq_lens):
        q_len = starts[b + 1] - starts[b]
        # Long queries share a call only with others of identical shape, so nothing is padded.
        key = (0, 0) if q_len <= MAX_BATCHED_QUERY_LEN else (q_len, seq_len)
        buckets.setdefault(key, []).append(b)
    groups = (_group(batch, seqs, starts, seq_lens, block_size) for seqs in buckets.values())
    return AttentionPlan(groups=tuple(groups))


def _group(
    batch: ForwardBatch, seqs: list[int], starts: list[int], seq_lens: list[int], block_size: int
) -> AttentionGroup:
    device = batch.input_ids.device
    q_lens = [starts[b + 1] - starts[b] for b in seqs]
    max_q, max_kv = max(q_lens), max(seq_lens[b] for b in seqs)
    # Index lists are built on the host, so no layer has to ask the device which rows are real.
    rows = [(g * max_q + i, starts[b] + i) for g, b in enumerate(seqs) for i in range(q_lens[g])]
    valid_rows = torch.tensor([r for r, _ in rows], device=device)  # [N]
    valid_tokens = torch.tensor([t for _, t in rows], device=device)  # [N]
    token_index = torch.zeros(len(seqs) * max_q, dtype=torch.int64, device=device)
    token_index[valid_rows] = valid_tokens
    token_index = token_index.view(len(seqs), max_q)  # [G, max_q]
    num_blocks = -(-max_kv // block_size)
    seq_index = torch.tensor(seqs, device=device)
    blocks = batch.block_tables[seq_index, :num_blocks].long().clamp_min(0)  # [G, num_blocks]
    token_valid = torch.zeros(len(seqs) * max_q, dtype=torch.bool, device=device)
    token_valid[valid_rows] = True
    # Padded query rows see key 0 only, so softmax stays finite; their output is dropped.
    query_pos = torch.where(token_valid.view(len(seqs), max_q), batch.positions[token_index], 0)  # [G, max_q]
    if all(q_len == seq_lens[b] for q_len, b in zip(q_lens, seqs)) and len(set(q_lens)) == 1:
        # Whole sequences of one length: positions 0..n-1 against keys 0..n-1 is plain causal.
        return AttentionGroup(token_index, valid_rows, valid_tokens, blocks, None, max_kv, query_pos)
    mask = _causal_mask(batch, query_pos, seq_index, num_blocks * block_size)
    return AttentionGroup(token_index, valid_rows, valid_tokens, blocks, mask, num_blocks * block_size, query_pos)


def _causal_mask(batch: ForwardBatch, query_pos: torch.Tensor, seq_index: torch.Tensor, num_keys: int) -> torch.Tensor:
    key_pos = torch.arange(num_keys, device=query_pos.device)  # [K]
    seq_lens = batch.seq_lens[seq_index].long()  # [G]
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [G, max_q, K]
    mask &= key_pos[None, None, :] < seq_lens[:, None, None]
    return mask[:, None]  # [G, 1, max_q, K]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan | DecodePlan | VarlenPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """query [T, Hq, D]; caches [num_blocks, block_size, Hkv, D] (new K/V already written) -> [T, Hq, D].
    window > 0: a query at position p sees keys p - window + 1 .. p only (a sliding-window layer);
    softcap > 0: scores s (scaled) become softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
    if isinstance(plan, DecodePlan):
        return paged_decode_attention(query, key_cache, value_cache, plan, scale, window, softcap)
    if isinstance(plan, VarlenPlan):
        return varlen_attention(query, key_cache, value_cache, plan, scale, window, softcap)
    out = torch.empty_like(query)
    for group in plan.groups:
        rows = _group_attention(query, key_cache, value_cache, group, scale, window, softcap)  # [N, Hq, D]
        out.index_copy_(0, group.valid_tokens, rows)
    return out


def _group_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: AttentionGroup, scale: float,
    window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    q = query[group.token_index].transpose(1, 2)  # [G, Hq, max_q, D]
    k = _read_blocks(key_cache, group)  # [G, Hkv, K, D]
    v = _read_blocks(value_cache, group)  # [G, Hkv, K, D]
    repeats = q.shape[1] // k.shape[1]
    if repeats > 1:
        k = k.repeat_interleave(repeats, dim=1)  # [G, Hq, K, D]
        v = v.repeat_interleave(repeats, dim=1)
    if window or softcap:  # SDPA takes no soft-capping: the same function, written out in fp32
        o = _explicit_attention(q, k, v, _windowed_mask(group, k.shape[2], window), scale, softcap)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, is_causal=group.mask is None, scale=scale)
    return o.transpose(1, 2).flatten(0, 1).index_select(0, group.valid_rows)  # [N, Hq, D]


def _windowed_mask(group: AttentionGroup, num_keys: int, window: int) -> torch.Tensor:
    """bool [G, 1, max_q, K]: the group's causal mask, and with window > 0 only the last `window` keys."""
    key_pos = torch.arange(num_keys, device=group.query_pos.device)[None, None, :]  # [1, 1, K]
    query_pos = group.query_pos[:, :, None]  # [G, max_q, 1]
    mask = group.mask[:, 0] if group.mask is not None else key_pos <= query_pos  # [G, max_q, K]
    if window:
        mask = mask & (key_pos > query_pos - window)
    return mask[:, None]


def _explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """softmax(cap(q k^T * scale) masked) v in fp32: q [G, H, Q, D], k, v [G, H, K, D], mask [G, 1, Q, K] -> q's dtype."""
    scores = q.float() @ k.float().transpose(-1, -2) * scale  # [G, H, Q, K]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def _read_blocks(cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    g, n = group.blocks.shape
    keys = cache[group.blocks].reshape(g, n * cache.shape[1], cache.shape[2], cache.shape[3])  # [G, K', Hkv, D]
    return keys[:, : group.num_keys].transpose(1, 2)


def paged_decode_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: DecodePlan, scale: float,
    window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    """query [B * query_len, Hq, D] -> [B * query_len, Hq, D]."""
    args = (query, key_cache, value_cache, plan.seq_lens, plan.block_tables, scale, plan.query_len)
    if plan.use_kernel:  # CUDA only
        from services.scheduler.model.triton_decode import paged_block_attention_triton

        # One program per (sequence, kv head) on the tensor cores, for decode too: faster than one
        # program per token at batch 1 and at batch 64.
        return paged_block_attention_triton(*args, plan.num_kv_splits, window=window, softcap=softcap)
    return paged_decode_attention_torch(*args, window, softcap)


def varlen_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: VarlenPlan, scale: float,
    window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    """query [T, Hq, D] of a ragged step -> [T, Hq, D]."""
    if plan.dense is not None and (window or softcap):
        raise ValueError("the dense path takes no sliding window or soft-capping (ModelRunner.dense_prefill)")
    if plan.dense is not None and (whole := plan.dense.whole_step(query.shape[0])) is not None:
        # a prompt alone: the dense call's output is the step's, with no kernel launch or copy beside it
        return attend_dense_sequence(query, key_cache, value_cache, plan.block_tables, whole, scale, plan.dense.config)
    tensors = (plan.query_start_loc, plan.seq_lens, plan.block_tables)
    if plan.use_kernel:  # where Triton is
        from services.scheduler.model.triton_varlen import varlen_attention_triton

        out = varlen_attention_triton(query, key_cache, value_cache, *tensors, plan.tiles, plan.block_m, scale,
                                      window=window, softcap=softcap, invariant=plan.invariant, kv_splits=plan.num_kv_splits)  # fmt: skip
    else:  # the twin computes the dense rows too; attend_dense overwrites them
        out = varlen_attention_torch(query, key_cache, value_cache, *tensors, scale, window, softcap, plan.invariant)
    if plan.dense is not None:  # rows the kernel left unwritten (no tiles)
        attend_dense(query, key_cache, value_cache, plan.block_tables, plan.dense, scale, out)
    return out


def varlen_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    invariant: bool = False,
) -> torch.Tensor:
    """The varlen kernel's reference (invariant: `batch_invariant.attend_rowwise`, with a host sync).
    Query token i of sequence b (q_len = query_start_loc[b + 1] - query_start_loc[b]) sits at position
    seq_lens[b] - q_len + i and sees keys 0 .. that position (the last `window` of them with window > 0).
    As in the kernel, sequences may be empty (q_len 0: padding) and tokens past query_start_loc[-1]
    belong to none (padding): the kernel stores nothing for them, the twin zeros (no host sync)."""
    num_tokens = query.shape[0]
    starts = query_start_loc.long()  # [B + 1]
    query_lens = starts.diff()  # [B]
    tokens = torch.arange(num_tokens, device=query.device)  # [T]
    covered = tokens < starts[-1]  # [T]
    token_seq = (torch.searchsorted(starts[1:], tokens, right=True)).clamp_max(len(query_lens) - 1)  # [T]
    index = tokens - starts[token_seq]  # [T], query index in its sequence
    visible = torch.where(covered, seq_lens.long()[token_seq] - query_lens[token_seq] + index + 1, 1)  # [T]
    if invariant:
        from services.scheduler.model.batch_invariant import attend_rowwise

        rows = (token_seq.tolist(), torch.where(covered, visible, 0).tolist())
        return attend_rowwise(query, key_cache, value_cache, *rows, block_tables, scale, window, softcap)
    out = attend_visible_keys(query, key_cache, value_cache, token_seq, visible, block_tables, scale, window, softcap)
    return out.masked_fill(~covered[:, None, None], 0.0)


def paged_decode_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    query_len: int = 1,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The decode kernel's reference, fp32 inside.

    query [T = B * query_len, Hq, D]; caches [N, block_size, Hkv, D]; seq_lens int32 [B];
    block_tables int32 [B, M]. Token t of sequence b = t // query_len sees keys
    0 .. seq_lens[b] - query_len + t % query_len (the last `window` of them with window > 0).
    """
    token_seq, visible = token_lengths(seq_lens, query_len)  # [T], [T]
    return attend_visible_keys(query, key_cache, value_cache, token_seq, visible, block_tables, scale, window, softcap)


def attend_visible_keys(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    token_seq: torch.Tensor,
    visible: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """softmax(q k^T * scale) v of each token t over keys 0 .. visible[t] - 1 of sequence token_seq[t]
    (visible[t] - window .. with window > 0; scores soft-capped with softcap > 0), fp32 inside;
    every block of the table is gathered per token. Query head h reads kv head h // (Hq / Hkv).
    query [T, Hq, D]; token_seq, visible int64 [T] -> [T, Hq, D]."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    blocks = block_tables.long().clamp_min(0)[token_seq]  # [T, M]
    keys = key_cache[blocks].flatten(1, 2).float()  # [T, K, Hkv, D]
    values = value_cache[blocks].flatten(1, 2).float()  # [T, K, Hkv, D]
    q = query.float().view(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [T, Hkv, G, D]
    scores = torch.einsum("bhgd,bkhd->bhgk", q, keys) * scale  # [T, Hkv, G, K]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(keys.shape[1], device=query.device)  # [K]
    seen = key_pos[None, :] < visible[:, None]  # [T, K]
    if window:
        seen &= key_pos[None, :] >= visible[:, None] - window
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgk,bkhd->bhgd", scores.softmax(dim=-1), values)  # [T, Hkv, G, D]
    return out.reshape(num_tokens, num_heads, head_dim).to(query.dtype)


def token_lengths(seq_lens: torch.Tensor, query_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence of each query token int64 [T], keys it sees int64 [T]) for query_len tokens per sequence."""
    tokens = torch.arange(seq_lens.shape[0] * query_len, device=seq_lens.device)  # [T]
    token_seq = tokens // query_len
    return token_seq, seq_lens.long()[token_seq] - (query_len - 1 - tokens % query_len)
