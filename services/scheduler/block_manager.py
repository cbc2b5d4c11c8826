"""KV cache blocks: which fixed-size blocks each request owns.

A request's table covers `capacity(rid)` token slots; the scheduler keeps the request's KV length
itself. Growing by several tokens at once (a speculative verify block) is one `allocate`; rolling
back rejected tokens is the scheduler lowering its length, optionally followed by `shrink` to give
whole trailing blocks back.

Blocks are refcounted: `fork` gives a child the parent's first full blocks (the choices of an
`n` > 1 request share their prompt's KV). A shared block is never written again: every writer
writes only past its own computed length, which lies past the shared blocks. A block returns to
the free list when its last holder frees it.

Each table is an int32 array grown by doubling (`_Table`): a step reads a long context's table as
one array view, where a list of thousands of ids cost the step's host time per sequence twice over
(copied into the plan, then converted by numpy), so a decode step's host time grew with the
context.
"""

from __future__ import annotations

import numpy as np

SMALL_RANGE = 32  # ranges up to this many positions are computed in plain Python


class _Table:
    """One request's block ids, in order, in an int32 array with room to grow; `view` is the ids held
    (remade on each change, so a step's reads make none)."""

    __slots__ = ("ids", "size", "view")

    def __init__(self, ids: np.ndarray | None = None) -> None:
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
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: lowest id popped first
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

    def num_new_blocks(self, rid: str, num_tokens: int) -> int:
        """Blocks `allocate(rid, num_tokens)` would take from the free list."""
        return self._num_new(self._tables.get(rid), num_tokens)

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
            table = self._tables[rid] = _Table()
        self._take(table, needed)
        return True

    def allocate(self, rid: str, num_tokens: int) -> None:
        """Grow `rid`'s table to hold `num_tokens` tokens in all (a no-op if it already does)."""
        table = self._tables.get(rid)
        needed = self._num_new(table, num_tokens)
        if needed > len(self._free):
            raise MemoryError(f"{rid}: needs {needed} KV blocks, {len(self._free)} free")
        if table is None:
            table = self._tables[rid] = _Table()
        self._take(table, needed)

    def _take(self, table: _Table, count: int) -> None:
        """`count` free blocks onto the end of `table`, each held once (the caller checked they are free)."""
        for _ in range(count):
            block = self._free.pop()
            self._refs[block] = 1
            table.append(block)

    def fork(self, parent: str, child: str, num_tokens: int) -> None:
        """`child` starts with the blocks of `parent`'s first `num_tokens` tokens (a whole number of
        blocks), shared, not copied."""
        if num_tokens % self.block_size or child in self._tables:
            raise ValueError(f"fork {parent} -> {child}: {num_tokens} tokens is not whole blocks, or {child} holds blocks")
        shared = self._tables[parent].view[: num_tokens // self.block_size]
        for block in shared.tolist():
            self._refs[block] += 1
        self._tables[child] = _Table(shared)

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
            self._free.append(block)

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
