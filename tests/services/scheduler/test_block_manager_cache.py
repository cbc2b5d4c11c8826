"""The block manager's prefix cache, alone: held blocks are never handed out, cached blocks no one
holds are evicted only when an allocation needs them (least recently released first), and a new
salt or a flush forgets every block."""

from __future__ import annotations

import random

from services.common.block_hash import block_hashes
from services.scheduler.block_manager import BlockManager

SIZE = 4


def hashes(tokens, salt=0):
    return block_hashes(tokens, SIZE, salt)


def check(blocks: BlockManager) -> None:
    held = {int(b) for rid in list(blocks._tables) for b in blocks.block_table(rid)}
    assert held.isdisjoint(blocks._free), "a held block is on the free queue"
    assert held | set(blocks._free) == set(range(blocks.num_blocks)), "a block leaked"


def test_a_cached_prefix_is_shared_not_copied_and_kept_after_its_holder_leaves():
    blocks = BlockManager(8, SIZE)
    tokens = list(range(10))  # 2 full blocks and 2 tokens
    blocks.allocate("a", 10)
    blocks.commit("a", hashes(tokens))
    first = blocks.block_table("a")[:2].tolist()
    assert blocks.cached_prefix("b", hashes(tokens + [99])) == first
    blocks.free("a")
    assert blocks.num_free_blocks == 8  # cached blocks no one holds count as free
    prefix = blocks.cached_prefix("b", hashes(tokens))
    assert prefix == first and blocks.num_new_blocks("b", 11, prefix) == 1 + 2  # the tail + the 2 taken off the queue
    blocks.allocate("b", 11, prefix)
    assert blocks.block_table("b")[:2].tolist() == first and blocks.num_free_blocks == 5
    blocks.allocate("c", 12, blocks.cached_prefix("c", hashes(tokens)))
    assert blocks.block_table("c")[:2].tolist() == first  # held twice now
    check(blocks)


def test_eviction_takes_empty_blocks_first_then_the_least_recently_released():
    blocks = BlockManager(4, SIZE)
    for rid, start in (("a", 0), ("b", 100)):
        tokens = list(range(start, start + 4))
        blocks.allocate(rid, 4)
        blocks.commit(rid, hashes(tokens))
    blocks.free("a")
    blocks.free("b")
    blocks.allocate("x", 8)  # the 2 empty blocks
    assert blocks.cached_prefix("y", hashes(list(range(4)))) and blocks.cached_prefix("y", hashes(list(range(100, 104))))
    blocks.allocate("z", 4)  # evicts a's block, released first
    assert blocks.cached_prefix("y", hashes(list(range(4)))) == []
    assert blocks.cached_prefix("y", hashes(list(range(100, 104)))) != []
    check(blocks)


def test_a_new_salt_or_a_flush_forgets_every_block():
    blocks = BlockManager(8, SIZE)
    tokens = list(range(8))
    blocks.allocate("a", 8)
    blocks.commit("a", hashes(tokens))
    blocks.cache.set_salt(7)
    assert blocks.cached_prefix("b", hashes(tokens)) == [] and blocks.cached_prefix("b", hashes(tokens, 7)) == []
    blocks.commit("a", hashes(tokens, 7))  # begun under the old salt: registers nothing
    assert blocks.cached_prefix("b", hashes(tokens, 7)) == []
    blocks.allocate("c", 8)
    blocks.commit("c", hashes(tokens, 7))
    assert len(blocks.cached_prefix("d", hashes(tokens, 7))) == 2
    assert blocks.cache.flush() == 2 and blocks.cached_prefix("d", hashes(tokens, 7)) == []
    check(blocks)


def test_random_traffic_never_hands_out_a_held_block_and_leaks_none():
    rng = random.Random(5)
    blocks, live, tokens_of = BlockManager(24, SIZE), [], {}
    content = {}  # block -> the token prefix it was registered for, where its holder registered it
    for step in range(3000):
        op = rng.random()
        if op < 0.45 and len(live) < 8:
            rid = f"r{step}"
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]  # few symbols: many shared prefixes
            chain = hashes(tokens)[: (len(tokens) - 1) // SIZE]
            prefix = blocks.cached_prefix(rid, chain)
            for i, block in enumerate(prefix):  # a cached block holds exactly the prefix that found it
                assert content[block] == tuple(tokens[: (i + 1) * SIZE])
            if blocks.num_new_blocks(rid, len(tokens), prefix) <= blocks.num_free_blocks:
                blocks.allocate(rid, len(tokens), prefix)
                blocks.commit(rid, chain)
                for i, block in enumerate(blocks.block_table(rid)[len(prefix) : len(chain)].tolist(), start=len(prefix)):
                    if blocks.cache.is_cached(block):
                        content[block] = tuple(tokens[: (i + 1) * SIZE])
                live.append(rid)
                tokens_of[rid] = tokens
        elif op < 0.6 and live:
            rid = rng.choice(live)
            blocks.ensure(rid, len(tokens_of[rid]) + rng.randrange(1, 9))
        elif live:
            blocks.free(live.pop(rng.randrange(len(live))))
        check(blocks)
    for rid in live:
        blocks.free(rid)
    assert blocks.num_free_blocks == 24
    check(blocks)
