"""`DraftProbs` keeps each sampled request's q [gamma, V] until its block is verified; it must not
keep the whole batch's q [P, gamma, V] alive through a view of one row."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from services.scheduler.spec.base import DraftProposal
from services.scheduler.worker.draft_probs import DraftProbs

GAMMA, VOCAB = 3, 50


def plan_of(samples: list[bool]) -> SimpleNamespace:
    steps = [SimpleNamespace(rid=f"r{i}", params=SimpleNamespace(samples_randomly=s)) for i, s in enumerate(samples)]
    return SimpleNamespace(steps=steps)


def kept_bytes(kept: DraftProbs) -> int:
    storages = {q.untyped_storage().data_ptr(): q.untyped_storage().nbytes() for q in kept._probs.values()}
    return sum(storages.values())


def test_sampled_rows_beside_greedy_ones_keep_only_their_own_q() -> None:
    samples = [True, False, False, True, False, False, False, False]  # 2 of 8 producers sample
    probs = torch.rand(len(samples), GAMMA, VOCAB)
    kept = DraftProbs()
    kept.keep(plan_of(samples), list(range(len(samples))), DraftProposal(torch.zeros(len(samples), GAMMA), probs))
    assert set(kept._probs) == {"r0", "r3"}
    assert kept_bytes(kept) == 2 * GAMMA * VOCAB * 4  # the two rows, not the batch's [8, gamma, V]
    torch.testing.assert_close(kept._probs["r3"], probs[3], rtol=0, atol=0)


def test_every_producer_sampling_keeps_views_of_the_batch() -> None:
    probs = torch.rand(4, GAMMA, VOCAB)
    kept = DraftProbs()
    kept.keep(plan_of([True] * 4), [0, 1, 2, 3], DraftProposal(torch.zeros(4, GAMMA), probs))
    assert kept_bytes(kept) == probs.nbytes  # no copy: the batch is all theirs
    assert kept._probs["r2"].data_ptr() == probs[2].data_ptr()
