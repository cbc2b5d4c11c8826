"""Temperature scaling of the confidence head (DSpark's STS): c_k = sigmoid(logit_k / tau).

`compact` multiplies confidences into prefix survivals and buys verify rows by them, so they must
be calibrated probabilities, not merely well ordered. tau is fitted on held-out drafts by
`sparkwire bench dspark-sts` (a log-spaced grid of temperatures, the one with the lowest expected
calibration error) and kept beside the drafter as `dspark_sts.json`; without a file tau = 1 (the
head as trained).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

STS_FILE = "dspark_sts.json"
TEMPERATURE_GRID = torch.logspace(-1, 1, 41, dtype=torch.float64)  # 0.1 .. 10
NUM_BINS = 10


def load_temperature(draft_dir: str | Path | None) -> float:
    path = None if draft_dir is None else Path(draft_dir) / STS_FILE
    if path is None or not path.is_file():
        return 1.0
    temperature = float(json.loads(path.read_text(encoding="utf-8"))["temperature"])
    if not temperature > 0:
        raise ValueError(f"{path}: temperature must be > 0, got {temperature}")
    return temperature


def save_temperature(draft_dir: str | Path, temperature: float, **about: object) -> Path:
    path = Path(draft_dir) / STS_FILE
    path.write_text(json.dumps({**about, "temperature": temperature}, indent=1), encoding="utf-8")
    return path


def expected_calibration_error(probs: torch.Tensor, outcomes: torch.Tensor, num_bins: int = NUM_BINS) -> float:
    """probs, outcomes [N] (outcomes in [0, 1]) -> sum over equal-width bins of |mean prob - mean outcome| * share."""
    probs, outcomes = probs.double().flatten(), outcomes.double().flatten()
    bins = (probs * num_bins).long().clamp(0, num_bins - 1)  # [N]
    gap = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, probs - outcomes)
    return float(gap.abs().sum() / max(len(probs), 1))


def fit_temperature(logits: torch.Tensor, outcomes: torch.Tensor) -> tuple[float, float]:
    """logits [N] (the head's, before the sigmoid), outcomes [N] -> (tau, its ECE), tau from the grid."""
    scores = [expected_calibration_error((logits.double() / tau).sigmoid(), outcomes) for tau in TEMPERATURE_GRID]
    best = min(range(len(scores)), key=scores.__getitem__)
    return float(TEMPERATURE_GRID[best]), scores[best]
