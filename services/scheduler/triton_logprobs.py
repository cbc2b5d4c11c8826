"""Raw-mode logprob rows in three Triton kernels: logits [c, V] (bf16 or f32, read in place and upcast
in registers) -> the columns `logprobs.logprob_columns` returns, equal to its torch path
(`_gather(_log_distribution(logits, None), ...)`): token [c], top-k values f32 [c, k] (descending, ties
by the smaller id), top-k ids int32 [c, k], requested ids' logprobs [c, m].

Imported lazily, only where Triton runs (`logprobs.runs_fused`: the caller's switch, on CUDA with
Triton; the interpreter in tests). Why this shape: the torch path's cost at 64-512 rows is its two
top-k passes over [c, V] and their [c, V] temporaries; here the row is read once, plus the ~k tiles
that can hold its top-k, and nothing of size [c, V] is written, so the prompt path can hand over bf16
logits (no f32 copy) in chunks of 1024 rows.

Each row is cut into S splits of whole BLOCK-column tiles, one program each (grid [c, S]); S comes
from the host ints c and V alone (`split_layout`: ~TARGET_PROGRAMS programs, so one row still fills
the GPU; 1 for a thousand rows), so a captured graph keeps it, and no kernel reads a device value on
the host: CUDA-graph safe.

1. `_partial_lse_kernel`: each split's max m_s and sum of exp(x - m_s), fp32, and each tile's max
   (the next tile's load in flight while this one is reduced).
2. `_candidates_kernel`: each program merges its row's S partials (m = max m_s, L = log sum_s l_s
   exp(m_s - m): every program of the row computes the same two numbers the same way) and keeps its
   split's best (in K_PAD >= k slots) as unique int64 keys of logprob = (x - m) - L (log_softmax's
   own order of operations, so values match torch to rounding of L): the fp32 logprob's bits made
   order-preserving in the high half, 2^32 - 1 - id in the low half, so a larger key is a larger
   logprob and, among equal logprobs, the smaller id. The kept k-th starts at a floor: the logprob
   of the k-th largest tile maximum of the row (k columns of distinct tiles reach it, so every
   column of the row's top-k does), so a split keeps only its columns at or above the floor (each
   insertion is a round of two reductions: the fewer, the faster). A tile is read only when its
   stored maximum's logprob reaches the k-th kept (the tile maxima come from kernel 1, screened as
   a vector, so the rest of the row is not read again), and then inserts only while its best key
   beats it.
3. `_finish_kernel` (grid [c]): the same m and L, the target's and requested ids' logprobs (gathers
   of x, same formula), and the top-k of the row's S * K_PAD candidates by k rounds of max, unpacked
   to value and id. The row's top-k is in the union of every split's top-k, so it is exact.

A greedy step's targets are its rows' argmax (`argmax_targets`): kernel 1 also keeps each split's
first column holding its maximum (a tile's by the reduction's tie-break to the left, then a later
tile's only where strictly larger), and kernel 3 takes the first split holding the row's maximum m,
so the target is the row's first largest logit, `torch.argmax`'s, written out as the step's token:
no pass of its own over the logits (rows holding a NaN aside, which `torch.argmax` would pick).

Ties: equal logits give bit-equal logprobs in both paths, and the key order breaks them by id, as
`top_k_sorted` does. Only distinct logits whose logprobs round together in one path and not the
other (a gap under one ulp of L) could order differently: never for bf16-valued logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.scheduler.logprobs import MAX_FUSED_K

# Columns a program reads at once, of any dtype (f32 output rows: 16 a thread at 4 warps; bf16 prompt
# chunks: 16 bf16). 2048 rather than 1024: faster at 64 rows, as fast or faster at every row count
# and for the prompt chunk.
BLOCK = 2048
MAX_SPLITS = 64
TARGET_PROGRAMS = 528  # 4 per SM of the H200's 132: a little faster than 2 per SM
MAX_CANDIDATES = 4096  # S * K_PAD: what `_finish_kernel` holds in registers for one row
RANK_CHUNK = 32  # tile maxima `_kth_tile_max` compares each one with at once ([tiles, 32]: 32 a thread at 75 tiles)
NO_KEY = tl.constexpr(-(2**63 - 1))  # below every key of a non-NaN logprob (their high half >= -2139095041)
OUT_OF_PLAY = tl.constexpr(2**63 - 1)  # above every key: a candidate slot past k, never the minimum, stored as NO_KEY


def max_splits_for(vocab_size: int, k_pad: int, block: int = BLOCK, most: int = MAX_SPLITS) -> int:
    """The most splits `split_layout` gives any number of rows (at one row): what the kernels pad to."""
    return split_layout(1, vocab_size, k_pad, block, most)[0]


def split_layout(num_rows: int, vocab_size: int, k_pad: int, block: int = BLOCK, most: int = MAX_SPLITS,
                 target_programs: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """(S, tiles per split), from host ints only: enough programs for target_programs, each split whole
    tiles and at least one, S <= most, S * k_pad <= MAX_CANDIDATES."""
    tiles = triton.cdiv(vocab_size, block)
    wanted = triton.cdiv(target_programs, max(num_rows, 1))
    splits = max(1, min(wanted, most, tiles, MAX_CANDIDATES // k_pad))
    per_split = triton.cdiv(tiles, splits)
    return triton.cdiv(tiles, per_split), per_split


# One k of each top-k pad up to k = 20, the tokenizer's default --max-logprobs (K_PAD 2, 4, 8, 16,
# 32: the graphs' k rungs 1, 5, 10, 20 and the exact k of eager rows, prompt rows among them), and
# 0 (no top-k).
WARM_KS = (0, 1, 3, 5, 10, 20)


def warm_kernels(vocab_size: int, device: torch.device, dtypes: tuple[torch.dtype, ...],
                 argmax_dtypes: tuple[torch.dtype, ...] = ()) -> None:  # fmt: skip
    """Compile the kernels now, for logits of each of `dtypes` and each of `WARM_KS`, with no
    requested ids, and their argmax-taking variant (greedy steps' rows) for each of `argmax_dtypes`:
    otherwise the first request asking for each would pause the step it is in for the whole
    compile. Other k pads and ids widths still compile on first use."""
    for dtype, argmax in [*((d, False) for d in dtypes), *((d, True) for d in argmax_dtypes)]:
        logits = torch.zeros(1, vocab_size, dtype=dtype, device=device)
        targets = torch.zeros(1, dtype=torch.int64, device=device)
        for k in WARM_KS:
            raw_logprob_columns(logits, targets, min(k, vocab_size), None, argmax_targets=argmax)


def raw_logprob_columns(
    logits: torch.Tensor, targets: torch.Tensor, k: int, ids: torch.Tensor | None, *, block: int | None = None,
    max_splits: int | None = None, target_programs: int = TARGET_PROGRAMS, out: tuple[torch.Tensor, ...] | None = None,
    argmax_targets: bool = False, invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [c, V] bf16/f16/f32, targets int64 [c], ids int64 [c, m] or None, 0 <= k <= min(MAX_FUSED_K, V)
    -> token f32 [c], top-k values f32 [c, k], top-k ids int32 [c, k], ids' logprobs f32 [c, m].
    out: those four, contiguous, to write into (`LogprobGraphs.greedy`'s one buffer); None: new ones.
    argmax_targets: targets (contiguous) is written, not read: each row's argmax, as `torch.argmax`
    gives it, which is then the row's target (a greedy step's token). invariant (`--deterministic`):
    the splits follow the vocabulary alone, as for one row, so a row's reduction order never depends
    on how many rows share the call.
    block (None: BLOCK), max_splits (None: MAX_SPLITS) and target_programs
    are for tests and the layout sweep (ops/bench/gpu_logprob_kernel_check.py --sweep)."""
    assert 0 <= k <= MAX_FUSED_K, k
    block = BLOCK if block is None else block
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    num_rows, vocab = logits.shape
    num_ids = ids.shape[1] if ids is not None else 0
    device = logits.device
    if out is None:
        out = (torch.empty(num_rows, dtype=torch.float32, device=device), torch.empty(num_rows, k, dtype=torch.float32, device=device),
               torch.empty(num_rows, k, dtype=torch.int32, device=device), torch.empty(num_rows, num_ids, dtype=torch.float32, device=device))  # fmt: skip
    else:
        assert all(t.is_contiguous() for t in out) and out[1].shape == out[2].shape == (num_rows, k), [t.shape for t in out]
    token, values, top_ids, requested = out
    assert not argmax_targets or targets.is_contiguous(), "argmax targets are written in place"
    if num_rows == 0:
        return token, values, top_ids, requested
    k_pad = max(2, triton.next_power_of_2(k))
    splits, per_split = split_layout(1 if invariant else num_rows, vocab, k_pad, block, MAX_SPLITS if max_splits is None else max_splits, target_programs)
    maxes = torch.empty(num_rows, splits, dtype=torch.float32, device=device)  # [c, S]
    sums = torch.empty_like(maxes)  # [c, S]
    # The pads are the most splits any number of rows gets at this vocabulary and k, not this call's
    # S: S follows the rows (1 row: ~50 splits; 64 rows: 5), and as a compile-time constant it made
    # Triton compile the three kernels again at every row count (in the step that first met it). So
    # S is a runtime argument and one compiled variant serves every row count.
    most_splits = max_splits_for(vocab, k_pad, block, MAX_SPLITS if max_splits is None else max_splits)
    splits_pad = triton.next_power_of_2(most_splits)
    num_tiles = triton.cdiv(vocab, block)
    tile_maxes = torch.empty(num_rows, num_tiles, dtype=torch.float32, device=device)  # [c, tiles]
    # each split's first column holding its max (argmax_targets; else unread)
    firsts = torch.empty(num_rows, splits, dtype=torch.int32, device=device) if argmax_targets else maxes
    _partial_lse_kernel[(num_rows, splits)](logits, maxes, sums, tile_maxes, firsts, logits.stride(0), vocab, per_split, splits,
                                            num_tiles, BLOCK=block, ARGMAX=argmax_targets)  # fmt: skip
    candidates = maxes  # unread when k == 0
    if k > 0:
        candidates = torch.empty(num_rows, splits, k_pad, dtype=torch.int64, device=device)  # [c, S, K_PAD]
        tiles_pad = triton.next_power_of_2(num_tiles)
        _candidates_kernel[(num_rows, splits)](logits, maxes, sums, tile_maxes, candidates, logits.stride(0), vocab, per_split, k,
                                               splits, num_tiles, SPLITS_PAD=splits_pad, BLOCK=block, K_PAD=k_pad,
                                               TILES_PAD=tiles_pad, RANK_CHUNK=min(RANK_CHUNK, tiles_pad))  # fmt: skip
    ids = ids.contiguous() if ids is not None else targets  # unread when m == 0
    _finish_kernel[(num_rows,)](logits, maxes, sums, candidates, firsts, targets.contiguous(), ids, token, values, top_ids,
                                requested, logits.stride(0), num_ids, k, splits, SPLITS_PAD=splits_pad, K_PAD=k_pad,
                                CANDIDATES_PAD=triton.next_power_of_2(most_splits * k_pad),
                                IDS_PAD=max(2, triton.next_power_of_2(num_ids)), HAS_TOP_K=k > 0, ARGMAX=argmax_targets)  # fmt: skip
    return token, values, top_ids, requested


# Ints that change with the rows or the request are not specialized on (value 1, divisibility by
# 16): each would be another compile of the kernel the first time a step met it.
@triton.jit(do_not_specialize=["tiles_per_split", "num_splits", "num_tiles"])
def _partial_lse_kernel(logits_ptr, max_ptr, sum_ptr, tile_max_ptr, first_ptr, stride_row, vocab_size, tiles_per_split,
                        num_splits, num_tiles, BLOCK: tl.constexpr, ARGMAX: tl.constexpr):  # fmt: skip
    row, split = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    first = split * tiles_per_split * BLOCK
    end = tl.minimum(first + tiles_per_split * BLOCK, vocab_size)
    cols = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    first_max = first  # ARGMAX: the split's first column holding its max (its first column while all are -inf)
    # The next tile's load is issued before this tile's two reductions, so one is always in flight.
    ahead = tl.load(row_ptr + first + cols, mask=first + cols < end, other=float("-inf"))
    for start in range(first, end, BLOCK):
        offs = start + cols
        x = ahead.to(tl.float32)  # [BLOCK]
        ahead = tl.load(row_ptr + offs + BLOCK, mask=offs + BLOCK < end, other=float("-inf"))
        if ARGMAX:
            tile_max, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
            first_max = tl.where(tile_max > m, start + at, first_max)  # an equal max in a later tile comes after
        else:
            tile_max = tl.max(x, 0)
        tl.store(tile_max_ptr + row * num_tiles + start // BLOCK, tile_max)
        m_new = tl.maximum(m, tile_max)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: sums stay 0, no NaN
        total = total * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)
        m = m_new
    tl.store(max_ptr + row * num_splits + split, m)
    tl.store(sum_ptr + row * num_splits + split, total)
    if ARGMAX:
        tl.store(first_ptr + row * num_splits + split, first_max)


@triton.jit
def _row_lse(max_ptr, sum_ptr, row, num_splits, SPLITS_PAD: tl.constexpr):
    # The row's max m and L = log(sum exp(x - m)) from its splits' partials (m_s, l_s).
    s = tl.arange(0, SPLITS_PAD)
    maxes = tl.load(max_ptr + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
    sums = tl.load(sum_ptr + row * num_splits + s, mask=s < num_splits, other=0.0)
    m = tl.max(maxes, 0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.log(tl.sum(sums * tl.exp(maxes - shift), 0))


@triton.jit
def _kth_tile_max(tile_max_ptr, row, num_tiles, k, TILES_PAD: tl.constexpr, RANK_CHUNK: tl.constexpr):
    # (the k-th largest of the row's tile maxima, -inf when it has fewer than k tiles; the maxima
    # [TILES_PAD], -inf past the row's tiles). k distinct columns reach the former (each tile's max
    # is a column of its own), so the row's top-k all do. Each maximum's rank (how many tiles are
    # ahead of it: larger, or equal at a smaller index) in chunks of RANK_CHUNK columns, not k rounds
    # of a max.
    t = tl.arange(0, TILES_PAD)
    maxima = tl.load(tile_max_ptr + row * num_tiles + t, mask=t < num_tiles, other=float("-inf"))  # [TILES_PAD]
    rank = tl.zeros([TILES_PAD], tl.int32)
    for first in tl.static_range(0, TILES_PAD, RANK_CHUNK):
        j = first + tl.arange(0, RANK_CHUNK)
        other = tl.load(tile_max_ptr + row * num_tiles + j, mask=j < num_tiles, other=float("-inf"))  # [RANK_CHUNK]
        ahead = (other[None, :] > maxima[:, None]) | ((other[None, :] == maxima[:, None]) & (j[None, :] < t[:, None]))
        rank += tl.sum(ahead.to(tl.int32), 1)
    return tl.max(tl.where((rank == k - 1) & (t < num_tiles), maxima, float("-inf")), 0), maxima


@triton.jit
def _ordered(logprob):
    # the f32's bits as an int32 in the float order (-0.0 never occurs: x - m is +0 at the max)
    bits = logprob.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _key(logprob, col):
    # int64, unique per column: larger logprob first, then the smaller id.
    return (_ordered(logprob).to(tl.int64) << 32) | (0xFFFFFFFF - col.to(tl.int64))


@triton.jit
def _insert_tile(best, kth, x, offs, end, m, lse):
    # The tile's keys that beat the kept k-th, each taking that slot: (kept keys, their minimum).
    key = tl.where(offs < end, _key((x - m) - lse, offs), NO_KEY)  # [BLOCK]
    top = tl.max(key, 0)
    while top > kth:
        best = tl.where(best == kth, top, best)
        kth = tl.min(best, 0)
        key = tl.where(key == top, NO_KEY, key)
        top = tl.max(key, 0)
    return best, kth


@triton.jit(do_not_specialize=["tiles_per_split", "k", "num_splits", "num_tiles"])
def _candidates_kernel(logits_ptr, max_ptr, sum_ptr, tile_max_ptr, cand_ptr, stride_row, vocab_size, tiles_per_split, k,
                       num_splits, num_tiles, SPLITS_PAD: tl.constexpr, BLOCK: tl.constexpr, K_PAD: tl.constexpr,
                       TILES_PAD: tl.constexpr, RANK_CHUNK: tl.constexpr):  # fmt: skip
    row, split = tl.program_id(0), tl.program_id(1)
    m, lse = _row_lse(max_ptr, sum_ptr, row, num_splits, SPLITS_PAD)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    first = split * tiles_per_split * BLOCK
    end = tl.minimum(first + tiles_per_split * BLOCK, vocab_size)
    cols = tl.arange(0, BLOCK)
    slots = tl.arange(0, K_PAD)
    # The floor: no column whose logprob is below the k-th largest tile maximum's is in the row's top-k.
    kth_tile_max, maxima = _kth_tile_max(tile_max_ptr, row, num_tiles, k, TILES_PAD, RANK_CHUNK)
    floor = _ordered((kth_tile_max - m) - lse).to(tl.int64) << 32
    # [K_PAD] kept keys: k slots in play, from distinct sentinels just above the floor (below every key
    # of a column at or above it: their low half, 2^32 - 1 - id, exceeds K_PAD), so the minimum is one
    # slot and a split keeps nothing under the floor; the rest out of play, so a tile stops inserting
    # once it no longer beats the k-th kept, not the K_PAD-th.
    best = tl.where(slots < k, floor + slots.to(tl.int64), OUT_OF_PLAY)
    kth = tl.min(best, 0)
    # A tile whose largest logit's logprob ranks below the k-th kept holds no better key (rounding
    # keeps x's order). Its largest logit is the one `_partial_lse_kernel` stored (the same tile of the
    # same split, so the same max), so such a tile is never read again: the split's tiles are screened
    # from the maxima the floor's ranking loaded, and only those at or above the k-th kept (~k tiles a
    # row, of 75) are read and inserted, in order, each screened against the k-th kept as it is then.
    t = tl.arange(0, TILES_PAD)
    first_tile = split * tiles_per_split
    tile_key = _ordered((maxima - m) - lse)  # int32 [TILES_PAD]
    pending = (t >= first_tile) & (t < first_tile + tiles_per_split) & (t < num_tiles) & (tile_key >= (kth >> 32).to(tl.int32))
    tile = tl.min(tl.where(pending, t, TILES_PAD), 0)
    while tile < TILES_PAD:
        offs = tile * BLOCK + cols
        x = tl.load(row_ptr + offs, mask=offs < end, other=float("-inf")).to(tl.float32)
        best, kth = _insert_tile(best, kth, x, offs, end, m, lse)
        pending = pending & (t > tile) & (tile_key >= (kth >> 32).to(tl.int32))
        tile = tl.min(tl.where(pending, t, TILES_PAD), 0)
    tl.store(cand_ptr + (row * num_splits + split) * K_PAD + slots, tl.where(slots < k, best, NO_KEY))


@triton.jit(do_not_specialize=["num_ids", "k", "num_splits"])
def _finish_kernel(logits_ptr, max_ptr, sum_ptr, cand_ptr, first_ptr, targets_ptr, ids_ptr, token_ptr, values_ptr,
                   top_ids_ptr, requested_ptr, stride_row, num_ids, k, num_splits, SPLITS_PAD: tl.constexpr,
                   K_PAD: tl.constexpr, CANDIDATES_PAD: tl.constexpr, IDS_PAD: tl.constexpr, HAS_TOP_K: tl.constexpr,
                   ARGMAX: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    m, lse = _row_lse(max_ptr, sum_ptr, row, num_splits, SPLITS_PAD)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    if ARGMAX:  # the first split holding the row's max holds its first such column
        s = tl.arange(0, SPLITS_PAD)
        maxes = tl.load(max_ptr + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
        split = tl.min(tl.where((maxes == m) & (s < num_splits), s, SPLITS_PAD), 0)
        target = tl.load(first_ptr + row * num_splits + split).to(tl.int64)
        tl.store(targets_ptr + row, target)
    else:
        target = tl.load(targets_ptr + row)
    tl.store(token_ptr + row, (tl.load(row_ptr + target).to(tl.float32) - m) - lse)
    j = tl.arange(0, IDS_PAD)
    wanted = tl.load(ids_ptr + row * num_ids + j, mask=j < num_ids, other=0)
    x = tl.load(row_ptr + wanted, mask=j < num_ids, other=0.0).to(tl.float32)
    tl.store(requested_ptr + row * num_ids + j, (x - m) - lse, mask=j < num_ids)
    if HAS_TOP_K:
        c = tl.arange(0, CANDIDATES_PAD)
        num_candidates = num_splits * K_PAD
        keys = tl.load(cand_ptr + row * num_candidates + c, mask=c < num_candidates, other=NO_KEY)
        for i in range(k):
            top = tl.max(keys, 0)
            high = (top >> 32).to(tl.int32)
            bits = tl.where(high >= 0, high, high ^ 0x7FFFFFFF)
            tl.store(values_ptr + row * k + i, bits.to(tl.float32, bitcast=True))
            tl.store(top_ids_ptr + row * k + i, (0xFFFFFFFF - (top & 0xFFFFFFFF)).to(tl.int32))
            keys = tl.where(keys == top, NO_KEY, keys)
