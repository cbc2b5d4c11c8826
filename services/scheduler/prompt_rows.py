"""Prompt logprob rows kept with the prefix cache's blocks, so a request asking for prompt
logprobs over a cached prefix gets them without computing it.

The row of prompt position p (token p's logprob and the top-k, from the model's output at p - 1)
is kept with the block holding p - 1, at p - 1's offset, with token p's id: the top-k depends
only on tokens 0..p-1, which the block's hash covers, and the id check makes the token's own
logprob exact for the block's last offset too (token p lies in the next block there). A block's
rows are kept at the largest k computed for it (top-k rows are sorted, so any smaller k is their
head); rows of a smaller k never replace them, a larger k starts the block anew. Requested ids'
rows (`token_ids_logprob`) are not kept: such a request computes its rows. Raw-mode rows only
(processed rows depend on each request's sampling parameters).
"""

from __future__ import annotations

import numpy as np

from services.common.logprob_rows import HostRows, RowLogprobs


class _BlockRows:
    __slots__ = ("token", "top_values", "top_ids", "next_ids", "have")

    def __init__(self, block_size: int, k: int) -> None:
        self.token = np.zeros(block_size, np.float32)  # [block_size]: the next token's logprob
        self.top_values = np.zeros((block_size, k), np.float32)  # [block_size, k]
        self.top_ids = np.zeros((block_size, k), np.int32)  # [block_size, k]
        self.next_ids = np.full(block_size, -1, np.int64)  # [block_size]: the next token's id
        self.have = np.zeros(block_size, bool)  # [block_size]: which offsets' rows are kept


class PromptRows:
    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity  # blocks' rows kept at most (the KV blocks'): the oldest kept go first
        self._rows: dict[int, _BlockRows] = {}  # block hash -> its offsets' rows, oldest first

    def __len__(self) -> int:
        return len(self._rows)

    def keep(self, hashes: list[int], tokens: list[int], first: int, rows: HostRows) -> None:
        """`rows` are prompt positions first, first + 1, ... of `tokens`, whose full blocks' hashes are `hashes`."""
        size, k = self.block_size, rows.top_values.shape[1]
        end = min(first + rows.num_rows, len(hashes) * size + 1)  # position p lives at p - 1
        for block in range((first - 1) // size, -(-(end - 1) // size)):
            lo, hi = max(first, block * size + 1), min(end, (block + 1) * size + 1)  # positions
            kept = self._rows.get(hashes[block])
            if kept is None or kept.top_values.shape[1] < k:
                kept = self._rows[hashes[block]] = _BlockRows(size, k)
                while len(self._rows) > self.capacity:
                    del self._rows[next(iter(self._rows))]
            elif kept.top_values.shape[1] > k:
                continue
            at, src = slice(lo - 1 - block * size, hi - 1 - block * size), slice(lo - first, hi - first)
            kept.token[at] = rows.token[src]
            kept.top_values[at] = rows.top_values[src]
            kept.top_ids[at] = rows.top_ids[src]
            kept.next_ids[at] = tokens[lo:hi]
            kept.have[at] = True

    def covered(self, hashes: list[int], tokens: list[int], first: int, k: int) -> int:
        """The end of the run of positions from `first` (>= 1) whose rows are kept at k or more."""
        size, position = self.block_size, first
        while position <= min(len(hashes) * size, len(tokens) - 1):
            block, offset = (position - 1) // size, (position - 1) % size
            kept = self._rows.get(hashes[block])
            if kept is None or kept.top_values.shape[1] < k:
                break
            wanted = np.asarray(tokens[position : (block + 1) * size + 1])  # [<= size - offset]
            bad = np.flatnonzero(~kept.have[offset : offset + len(wanted)] | (kept.next_ids[offset : offset + len(wanted)] != wanted))
            if bad.size:
                return position + int(bad[0])
            position += len(wanted)
        return position

    def rows(self, hashes: list[int], first: int, end: int, k: int) -> RowLogprobs:
        """Rows of positions [first, end) (all kept: `covered`), their top-k cut to k, no requested ids."""
        size, parts = self.block_size, []
        for block in range((first - 1) // size, -(-(end - 1) // size)):
            kept = self._rows[hashes[block]]
            at = slice(max(first, block * size + 1) - 1 - block * size, min(end, (block + 1) * size + 1) - 1 - block * size)
            parts.append(RowLogprobs.of(kept.token[at].copy(), kept.top_values[at, :k].copy(), kept.top_ids[at, :k].copy()))
        return RowLogprobs.joined(parts).at(first)

    def drop(self, h: int) -> None:
        self._rows.pop(h, None)

    def clear(self) -> None:
        self._rows.clear()
