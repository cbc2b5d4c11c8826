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
