"""Verify lengths from the confidence head: best prefix-survival rows first, prefixes only."""

from __future__ import annotations

import torch

from services.scheduler.spec.verify_plan import best_extra_rows, prefix_survival, verify_lengths


def test_the_rows_with_the_highest_survival_win():
    confidence = torch.tensor([[0.9, 0.9, 0.1], [0.5, 0.9, 0.9]])  # survival [.9 .81 .081], [.5 .45 .405]
    assert verify_lengths(confidence, 3).tolist() == [2, 1]
    assert verify_lengths(confidence, 0).tolist() == [0, 0]
    assert verify_lengths(confidence, 100).tolist() == [3, 3]


def test_equal_survivals_keep_each_request_a_prefix():
    assert verify_lengths(torch.ones(2, 3), 4).tolist() == [3, 1]


def test_random_confidences_give_prefixes_that_use_the_budget():
    confidence = torch.rand(16, 7, generator=torch.Generator().manual_seed(0))
    for budget in (0, 5, 40, 112):
        lengths = verify_lengths(confidence, budget)
        assert int(lengths.sum()) == budget
        survival = prefix_survival(confidence)
        chosen = torch.arange(7)[None, :] < lengths[:, None]
        if chosen.any() and (~chosen).any():  # every chosen row beats every row left out
            assert survival[chosen].min() >= survival[~chosen].max()


def test_best_extra_rows_maximises_expected_tokens_per_second():
    confidence = torch.tensor([[0.9, 0.5]])  # survival .9, .45
    # t(n) = 1 + n/2: E=0 -> 1/1.5, E=1 -> 1.9/2 = .95, E=2 -> 2.35/2.5 = .94
    assert best_extra_rows(confidence, lambda rows: 1 + 0.5 * rows) == 1
    assert best_extra_rows(confidence, lambda rows: 1.0) == 2  # free rows: verify everything
