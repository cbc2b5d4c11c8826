"""What one target step of T tokens costs (DSpark's steps-per-second table), for `compact`'s verify budget.

A table of (tokens, seconds) points measured on the serving device by `sparkwire bench dspark-sps`
and kept beside the drafter as `dspark_sps.json`. Between points the cost is linear; past the
last point it keeps the last segment's slope, below the first it is the first point's. Without a
file, `DEFAULT_POINTS`: flat while the weights' reads dominate, then linear in tokens, the shape of
a dense model's step on a GPU (relative units: only ratios of costs matter to the budget).
Torch-free (numpy): the policy reads it.
"""

from __future__ import annotations

import bisect
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPS_FILE = "dspark_sps.json"
DEFAULT_POINTS: tuple[tuple[int, float], ...] = ((1, 1.0), (128, 1.0), (1024, 8.0))


@dataclass(frozen=True)
class StepCost:
    points: tuple[tuple[int, float], ...] = DEFAULT_POINTS  # (tokens, seconds), tokens strictly increasing

    def __post_init__(self) -> None:
        tokens = [t for t, _ in self.points]
        if not self.points or any(a >= b for a, b in zip(tokens, tokens[1:])) or tokens[0] < 1:
            raise ValueError(f"step cost points need strictly increasing token counts >= 1, got {tokens}")
        if any(seconds <= 0 for _, seconds in self.points):
            raise ValueError("step cost points need positive seconds")

    def __call__(self, num_tokens: int) -> float:
        """Seconds for a step of `num_tokens` tokens."""
        points = self.points
        index = bisect.bisect_left(points, (num_tokens, float("-inf")))
        if index < len(points) and points[index][0] == num_tokens:
            return points[index][1]
        if index == 0:
            return points[0][1]
        (t0, s0), (t1, s1) = points[index - 1], points[min(index, len(points) - 1)]
        if index == len(points):  # past the last point: the last segment's slope
            if len(points) == 1:
                return s0
            (t0, s0), (t1, s1) = points[-2], points[-1]
        return s0 + (s1 - s0) * (num_tokens - t0) / (t1 - t0)

    @functools.cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray([t for t, _ in self.points], np.float64), np.asarray([s for _, s in self.points], np.float64)

    def many(self, num_tokens: np.ndarray) -> np.ndarray:
        """`self(t)` for every t of `num_tokens` (int [N]) -> float64 [N]."""
        tokens, seconds = self._arrays
        out = np.interp(num_tokens, tokens, seconds)  # flat outside the points
        if len(tokens) > 1:
            slope = (seconds[-1] - seconds[-2]) / (tokens[-1] - tokens[-2])
            past = num_tokens > tokens[-1]
            out[past] = seconds[-1] + slope * (num_tokens[past] - tokens[-1])
        return out

    @classmethod
    def load(cls, draft_dir: str | Path | None) -> StepCost:
        """The table beside the drafter, or the default where there is none."""
        path = None if draft_dir is None else Path(draft_dir) / SPS_FILE
        if path is None or not path.is_file():
            return cls()
        raw = json.loads(path.read_text(encoding="utf-8"))
        return cls(tuple((int(t), float(s)) for t, s in raw["points"]))

    def save(self, path: str | Path, **about: object) -> None:
        """`about`: where it was measured (device, model, batch sizes), kept beside the points."""
        Path(path).write_text(json.dumps({**about, "points": [list(p) for p in self.points]}, indent=1), encoding="utf-8")
