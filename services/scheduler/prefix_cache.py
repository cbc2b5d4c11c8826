"""The prefix cache's index: which KV block holds the full block of tokens a hash names.

The blocks themselves stay the `BlockManager`'s: a block whose KV is computed and full is
registered here (`add`), shared by refcount with every request whose prompt starts with the same
blocks, and kept, once no request holds it, on the block manager's free queue behind the blocks
that hold nothing; it is evicted (`evict`) only when an allocation takes it, least recently
released first. `salt` is folded into every hash (`block_hash.py`): whatever changes the KV
(a weight swap) sets a new one (`set_salt`), after which no earlier block is ever found again.
"""

from __future__ import annotations

import numpy as np

from services.common.block_hash import extend_hashes
from services.scheduler.prompt_rows import PromptRows


class PrefixCache:
    def __init__(self, block_size: int, enabled: bool = True, salt: int = 0, num_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self.salt = salt
        self.rows = PromptRows(block_size, num_blocks)  # prompt logprob rows of cached blocks' positions
        self._block_of: dict[int, int] = {}  # hash -> block
        self._hash_of: dict[int, int] = {}  # block -> hash
        self.version = 0  # changes whenever the set of cached hashes does (summaries go out when it did)

    def __len__(self) -> int:
        return len(self._block_of)

    def hashes(self, known: list[int], tokens: list[int]) -> list[int]:
        """The chain over `tokens`' full blocks, `known` (its first hashes, same salt) grown in place."""
        return extend_hashes(known, tokens, self.block_size, self.salt) if self.enabled else known

    def lookup(self, hashes: list[int]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (the first miss ends it)."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def add(self, block: int, h: int) -> bool:
        """Register `block` as holding the tokens `h` names; False (nothing kept) where another block
        already does or the block holds other cached tokens."""
        if not self.enabled or h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        self.version += 1
        return True

    def evict(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            self.rows.drop(h)
            self.version += 1

    def flush(self) -> int:
        """Forget every cached block (held ones stay held, never found again); how many were cached."""
        count = len(self._block_of)
        self._block_of.clear()
        self._hash_of.clear()
        self.rows.clear()
        self.version += 1
        return count

    def set_salt(self, salt: int) -> None:
        """Whatever the KV depends on changed (new weights): forget everything, and key new blocks by `salt`."""
        self.flush()
        self.salt = salt

    def summary(self, limit: int) -> np.ndarray:
        """u4 [<= limit]: the low 32 bits of the newest cached blocks' hashes (`PrefixSummary`). Read
        from the event loop while the step thread runs: `list` copies the dict in one C call (int
        keys), under the GIL."""
        hashes = list(self._block_of)[-limit:]
        return (np.asarray(hashes, np.uint64) & np.uint64(0xFFFFFFFF)).astype("<u4")
