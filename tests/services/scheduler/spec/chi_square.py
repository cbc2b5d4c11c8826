"""Pearson's chi-square goodness-of-fit p-value, for the sampling tests (no scipy needed)."""

from __future__ import annotations

import torch


def chi_square_p_value(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """samples int64 [N] of cells 0..C-1; expected probabilities [C]. 0.0 when an impossible cell occurs."""
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    possible = expected > 0
    if counts[~possible].sum() > 0:
        return 0.0
    mean = samples.numel() * expected[possible].double()
    statistic = ((counts[possible] - mean) ** 2 / mean).sum()
    half_dof = torch.tensor((int(possible.sum()) - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(half_dof, statistic / 2))  # P(chi2_dof > statistic)


def pooled_p_value(samples: torch.Tensor, expected: torch.Tensor, min_count: float = 5.0) -> float:
    """`chi_square_p_value` over the cells expected at least `min_count` times in N samples, every
    other cell pooled into one (a vocabulary's long tail: too few expected for the test's approximation)."""
    kept = expected.double() * samples.numel() >= min_count  # [C]
    cell_of = torch.full_like(expected, int(kept.sum()), dtype=torch.int64)  # the pooled cell last
    cell_of[kept] = torch.arange(int(kept.sum()))
    pooled = torch.cat([expected.double()[kept], expected.double()[~kept].sum()[None]])
    return chi_square_p_value(cell_of[samples], pooled)
