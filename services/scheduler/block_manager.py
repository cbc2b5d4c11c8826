"""KV cache blocks: which fixed-size blocks each request owns.

A request's table covers `capacity(rid)` token slots; the scheduler keeps the request's KV length
itself. Growing by several tokens at once (a speculative verify block) is one `allocate`; rolling
back rejected tokens is the scheduler lowering its length, optionally followed by `shrink` to give
whole trailing blocks back.

Blocks are refcounted: `fork` gives a child the parent's first full blocks (the choices of an
`n` > 1 request share their prompt's KV), and `allocate` starts a table from a cached prefix (the
prefix cache, `prefix_cache.py`: `cached_prefix`, then `commit` registers a table's computed full
blocks). A shared block is never written again: every writer writes only past its own computed
length, which lies past the shared blocks. A block returns to the free queue when its last holder
frees it: at its front if it holds nothing cached, at its back if it does, so allocation takes
empty blocks first, then evicts cached ones least recently released first (lazy eviction: a cached
block stays findable until taken).

Each table is an int32 array grown by doubling (`_Table`): a step reads a long context's table as
one array view, where a list of thousands of ids cost the step's host time per sequence twice over
(copied into the plan, then converted by numpy), so a decode step's host time grew with the
context.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from services.scheduler.prefix_cache import PrefixCache

SMALL_RANGE = 32  # ranges up to this many positions are computed in plain Python


class _Table:
    """One request's block ids, in order, in an int32 array with room to grow; `view` is the ids held
    (remade on each change, so a step's reads make none)."""

    __slots__ = ("ids", "size", "view", "num_hashed", "salt")

    def __init__(self, salt: int, ids: np.ndarray | None = None) -> None:
        self.salt = salt  # the cache's salt when the table began: its blocks are registered under it only
        self.num_hashed = 0  # leading blocks `commit` went over
        self.size = 0 if ids is None else len(ids)
        self.ids = np.zeros(max(8, self.size), np.int32)  # [capacity]
        self.ids[: self.size] = ids if ids is not None else []
        self.view = self.ids[: self.size]

    def append(self, block: int) -> None:
        if self.size == len(self.ids):
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
        self.ids[self.size] = block
        self.size += 1
        self.view = self.ids[: self.size]

    def pop(self) -> int:
        self.size -= 1
        self.view = self.ids[: self.size]
        return self.ids.item(self.size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = PrefixCache(block_size, prefix_caching, num_blocks=num_blocks)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # taken from the front
        self._tables: dict[str, _Table] = {}
        self._refs = [0] * num_blocks  # holders of each block

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def capacity(self, rid: str) -> int:
        table = self._tables.get(rid)
        return 0 if table is None else table.size * self.block_size

    def num_new_blocks(self, rid: str, num_tokens: int, prefix: list[int] | None = None) -> int:
        """Blocks `allocate(rid, num_tokens, prefix)` would take from the free queue (cached blocks no
        one holds are on it)."""
        if not prefix:
            return self._num_new(self._tables.get(rid), num_tokens)
        refs = self._refs
        return max(0, self.num_blocks_for(num_tokens) - len(prefix)) + sum(refs[b] == 0 for b in prefix)

    def cached_prefix(self, rid: str, hashes: list[int]) -> list[int]:
        """The cached blocks `rid` could start from (a request that holds no blocks yet)."""
        return [] if rid in self._tables else self.cache.lookup(hashes)

    def _num_new(self, table: _Table | None, num_tokens: int) -> int:
        return max(0, self.num_blocks_for(num_tokens) - (0 if table is None else table.size))

    def can_allocate(self, rid: str, num_tokens: int) -> bool:
        return self.num_new_blocks(rid, num_tokens) <= len(self._free)

    def ensure(self, rid: str, num_tokens: int) -> bool:
        """`allocate` where the free blocks allow it (True), else nothing taken (False): one check
        for the commonest call, a decode whose blocks already hold its next token."""
        table = self._tables.get(rid)
        needed = self._num_new(table, num_tokens)
        if needed == 0:
            return True
        if needed > len(self._free):
            return False
        if table is None:
            table = self._tables[rid] = _Table(self.cache.salt)
        self._take(table, needed)
        return True

    def allocate(self, rid: str, num_tokens: int, prefix: list[int] | None = None) -> None:
        """Grow `rid`'s table to hold `num_tokens` tokens in all (a no-op if it already does); a
        table that does not exist yet starts with the cached blocks `prefix` (`cached_prefix`)."""
        needed = self.num_new_blocks(rid, num_tokens, prefix)
        if needed > len(self._free):
            raise MemoryError(f"{rid}: needs {needed} KV blocks, {len(self._free)} free")
        table = self._tables.get(rid)
        if table is None:
            table = self._tables[rid] = _Table(self.cache.salt, self._hold(prefix) if prefix else None)
            table.num_hashed = table.size
        self._take(table, self._num_new(table, num_tokens))

    def _hold(self, blocks: list[int]) -> np.ndarray:
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        return np.asarray(blocks, np.int32)

    def _take(self, table: _Table, count: int) -> None:
        """`count` free blocks onto the end of `table`, each held once (the caller checked they are
        free); a cached block taken is evicted."""
        for _ in range(count):
            block = self._free.popitem(last=False)[0]
            self._refs[block] = 1
            if self.cache.is_cached(block):
                self.cache.evict(block)
            table.append(block)

    def commit(self, rid: str, hashes: list[int]) -> None:
        """Register `rid`'s leading full blocks as cached: `hashes` (the chain over its tokens) covers
        only blocks whose KV is computed. A table begun under another salt registers nothing."""
        table = self._tables.get(rid)
        if table is None or table.salt != self.cache.salt or not self.cache.enabled:
            return
        for index in range(table.num_hashed, min(len(hashes), table.size)):
            self.cache.add(table.ids.item(index), hashes[index])
        table.num_hashed = max(table.num_hashed, min(len(hashes), table.size))

    def fork(self, parent: str, child: str, num_tokens: int) -> None:
        """`child` starts with the blocks of `parent`'s first `num_tokens` tokens (a whole number of
        blocks), shared, not copied."""
        if num_tokens % self.block_size or child in self._tables:
            raise ValueError(f"fork {parent} -> {child}: {num_tokens} tokens is not whole blocks, or {child} holds blocks")
        shared = self._tables[parent].view[: num_tokens // self.block_size]
        for block in shared.tolist():
            self._refs[block] += 1
        self._tables[child] = _Table(self._tables[parent].salt, shared)

    def shrink(self, rid: str, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (rollback)."""
        table = self._tables.get(rid)
        keep = self.num_blocks_for(num_tokens)
        while table is not None and table.size > keep:
            self._release(table.pop())

    def free(self, rid: str) -> None:
        table = self._tables.pop(rid, None)
        for block in reversed(table.view.tolist() if table is not None else []):
            self._release(block)

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None  # at the back: a cached block, evicted last
            if not self.cache.is_cached(block):
                self._free.move_to_end(block, last=False)

    def holds(self, rid: str) -> bool:
        return rid in self._tables

    def block_table(self, rid: str) -> np.ndarray:
        """int32 [blocks held]: a view, valid until `rid`'s table next changes (read it in the step
        that asked for it)."""
        table = self._tables.get(rid)
        return table.view if table is not None else np.zeros(0, np.int32)

    def slots(self, rid: str, start: int, end: int) -> list[int] | np.ndarray:
        """Cache slots of token positions [start, end): block_id * block_size + offset. A short range
        (a decode or verify block) comes as a list: numpy's per-call cost would dominate, and the
        worker flattens a step's lists in one conversion; a long one (a prefill chunk) as int64 [end - start]."""
        table, size = self._tables[rid], self.block_size
        if end - start <= SMALL_RANGE:
            item = table.ids.item
            return [item(p // size) * size + p % size for p in range(start, end)]
        positions = np.arange(start, end, dtype=np.int64)  # [end - start]
        return table.view.astype(np.int64)[positions // size] * size + positions % size
