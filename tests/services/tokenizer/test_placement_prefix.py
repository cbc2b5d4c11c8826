"""Cache-aware placement's choice alone: the longest cached prefix wins, balanced against load;
stale summaries and prompts no one caches go to the queue group."""

from __future__ import annotations

import numpy as np
import pytest

from contracts.tokenizer import PrefixSummary
from services.common.arrays import to_wire
from services.common.block_hash import block_hashes
from services.tokenizer import placement
from services.tokenizer.placement import Placement

PROMPT = tuple(range(100, 180))  # 5 blocks of 16


def summary(sid: str, num_blocks: int, num_held: int = 0, salt: int = 0) -> PrefixSummary:
    hashes = [h & 0xFFFFFFFF for h in block_hashes(PROMPT, 16, salt)[:num_blocks]]
    return PrefixSummary(sid, salt, 16, to_wire(np.asarray(hashes + [7], "<u4")), num_held, 64)


async def placed(*summaries: PrefixSummary) -> Placement:
    chosen = Placement(config=None, transport=None)  # type: ignore[arg-type]
    for each in summaries:
        await chosen.on_summary(each, None)  # type: ignore[arg-type]
    return chosen


async def test_the_longest_cached_prefix_wins():
    assert (await placed(summary("a", 2), summary("b", 4))).holder(PROMPT) == "b"
    assert (await placed(summary("a", 3), summary("b", 1, salt=9))).holder(PROMPT) == "a"  # b's salt: its blocks differ
    assert (await placed(summary("a", 0), summary("b", 0))).holder(PROMPT) is None
    assert (await placed()).holder(PROMPT) is None


async def test_a_full_or_far_busier_holder_is_passed_over():
    assert (await placed(summary("a", 4, num_held=64), summary("b", 0))).holder(PROMPT) is None
    assert (await placed(summary("a", 4, num_held=40), summary("b", 0, num_held=2))).holder(PROMPT) is None
    assert (await placed(summary("a", 4, num_held=20), summary("b", 0, num_held=2))).holder(PROMPT) == "a"


async def test_a_stale_summary_is_ignored(monkeypatch: pytest.MonkeyPatch):
    chosen = await placed(summary("a", 4))
    monkeypatch.setattr(placement, "SUMMARY_STALE_S", -1.0)
    assert chosen.holder(PROMPT) is None
