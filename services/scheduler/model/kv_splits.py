"""Split-KV's split count: how many programs of the decode kernel (`triton_decode.py`) share the
keys of one (sequence, kv head). Pure host arithmetic, here rather than in `triton_decode` (which
imports Triton at the top) so that the runner and the graph runner build their plans without it.

The count depends on shapes the host knows (batch rows, kv heads, table width, SMs) and on no
device value, so a CUDA graph captured for a rung keeps the count it was captured with.
"""

from __future__ import annotations

TARGET_PROGRAMS_PER_SM = 2  # split-KV aims at this many attention programs per SM
MAX_SPLITS = 32  # the combine kernel holds every split's partial of one row: [MAX_SPLITS, D] fp32


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, num_sms: int) -> int:
    """Key splits per (sequence, kv head): enough programs for TARGET_PROGRAMS_PER_SM on every SM,
    at most one split per block of the table (max_blocks) and MAX_SPLITS; 1 once the batch alone
    fills the device, and 1 for num_sms 0 (split-KV off)."""
    wanted = -(-TARGET_PROGRAMS_PER_SM * num_sms // (num_seqs * num_kv_heads))
    return max(1, min(wanted, max_blocks, MAX_SPLITS))
