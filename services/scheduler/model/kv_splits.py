"""Split-KV's split count: how many programs of the decode kernel (`triton_decode.py`) share the
keys of one (sequence, kv head); and, in the deterministic mode, how many programs of the varlen
kernel (`triton_varlen.py`) share a tile's keys. Pure host arithmetic, here rather than in the
kernels' modules (which import Triton at the top) so that the runner and the graph runners build
their plans without it.

The counts depend on shapes the host knows (batch rows, kv heads, table width, SMs) and on no
device value, so a CUDA graph captured for a rung keeps the count it was captured with.

The two differ in what they fix. The decode kernel's split count changes a row's reduction order
(a split's length follows the count), which is why the deterministic mode never takes that kernel.
The varlen kernel's invariant mode splits by size: keys 0 .. KV_SPLIT_TOKENS - 1, then the next
KV_SPLIT_TOKENS, ..., each split an online softmax of its own, merged in split order; a program
that walks several splits merges them as the merge kernel does, so the count only says how the
work is spread, never what a row computes.
"""

from __future__ import annotations

TARGET_PROGRAMS_PER_SM = 2  # split-KV aims at this many attention programs per SM
MAX_SPLITS = 32  # the combine kernel holds every split's partial of one row: [MAX_SPLITS, D] fp32
KV_SPLIT_TOKENS = 256  # the deterministic mode's keys per split, whatever the batch (a multiple of every block_n)
MAX_SPLIT_PARTIALS = 8192  # query tokens x splits of one invariant split launch: its partials, [T, Hq, S, D] fp32 (128 MiB at Hq D 4096)


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, num_sms: int) -> int:
    """Key splits per (sequence, kv head): enough programs for TARGET_PROGRAMS_PER_SM on every SM,
    at most one split per block of the table (max_blocks) and MAX_SPLITS; 1 once the batch alone
    fills the device, and 1 for num_sms 0 (split-KV off)."""
    wanted = -(-TARGET_PROGRAMS_PER_SM * num_sms // (num_seqs * num_kv_heads))
    return max(1, min(wanted, max_blocks, MAX_SPLITS))


def invariant_kv_splits(num_tiles: int, num_kv_heads: int, num_tokens: int, max_keys: int, num_sms: int) -> int:
    """Programs per varlen tile along the keys in the deterministic mode: one per KV_SPLIT_TOKENS
    keys of the longest sequence (max_keys) where the tiles alone leave SMs idle and the partials
    stay within MAX_SPLIT_PARTIALS; else 1 (each program walks its tile's splits). num_sms 0: 1."""
    splits = -(-max_keys // KV_SPLIT_TOKENS)
    if splits <= 1 or num_tiles * num_kv_heads >= num_sms or num_tokens * splits > MAX_SPLIT_PARTIALS:
        return 1
    return splits
