"""Accept lengths replayed into timed DSpark runs: a distribution, drawn per request and per step.

A DSpark step's speed with dummy weights depends on how many tokens each verify commits. Instead
of one fixed length, a run draws each request's length at each step from a distribution over
n = 1 .. gamma + 1 tokens a verify commits (the bonus token included), independently:

- measured: a JSON file whose `accept_length_counts` are verify passes by tokens gained (index =
  tokens, as the scheduler's `spec_accept_lengths` metric, `sparkwire bench trained-pair` and
  `sparkwire bench gpu-core --pair` write them);
- `--simulate-accept-len N`: every verify commits N (the old fixed length);
- default: each draft survives with probability ALPHA given the ones before it (a geometric
  length cut at gamma + 1), ALPHA = 0.79, mean 4.04 tokens a verify at gamma = 7.

A perfectly calibrated confidence head that knows nothing per request reports, for draft k, the
chance the length reaches k + 1 given it reached k (`hazards`); `compact` runs are fed those, so
its verify budget sees what the replay will accept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

ALPHA = 0.79


@dataclass(frozen=True)
class AcceptReplay:
    probs: tuple[float, ...]  # [gamma + 2]: P(a verify commits n tokens), n = 0 .. gamma + 1 (n = 0 never)
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.probs) < 2 or self.probs[0] != 0 or abs(sum(self.probs) - 1) > 1e-6 or min(self.probs) < 0:
            raise ValueError(f"accept length probabilities need P(0) = 0 and a sum of 1, got {self.probs}")

    @property
    def gamma(self) -> int:
        return len(self.probs) - 2

    @property
    def mean(self) -> float:
        return sum(n * p for n, p in enumerate(self.probs))

    @classmethod
    def geometric(cls, gamma: int, alpha: float = ALPHA) -> AcceptReplay:
        probs = [0.0] + [alpha ** (n - 1) * (1 - alpha) for n in range(1, gamma + 1)] + [alpha**gamma]
        return cls(tuple(probs))

    @classmethod
    def fixed(cls, gamma: int, tokens: int) -> AcceptReplay:
        if not 1 <= tokens <= gamma + 1:
            raise ValueError(f"a verify commits 1 .. {gamma + 1} tokens, got {tokens}")
        return cls(tuple(float(n == tokens) for n in range(gamma + 2)))

    @classmethod
    def from_counts(cls, counts: list[int], gamma: int) -> AcceptReplay:
        """Counts by tokens gained; lengths past gamma + 1 (a longer-block drafter's) count as gamma + 1."""
        folded = [0.0] * (gamma + 2)
        for n, count in enumerate(counts):
            folded[min(max(n, 1), gamma + 1)] += count
        total = sum(folded)
        if total <= 0:
            raise ValueError("accept length counts are all zero")
        return cls(tuple(c / total for c in folded))

    @classmethod
    def load(cls, path: Path, gamma: int) -> AcceptReplay:
        """`accept_length_counts` at the top, or summed over a `gpu-core --pair` run's DSpark rows."""
        document = json.loads(Path(path).read_text(encoding="utf-8"))
        if "accept_length_counts" in document:
            return cls.from_counts(document["accept_length_counts"], gamma)
        rows = [r["accept_length_counts"] for r in document.get("pair", []) if "accept_length_counts" in r]
        if not rows:
            raise ValueError(f"{path}: no accept_length_counts (at the top, or in `pair` rows)")
        return cls.from_counts([sum(column) for column in zip(*rows)], gamma)

    def hazards(self) -> list[float]:
        """[gamma]: P(n >= k + 2 | n >= k + 1), the chance draft k + 1 survives once the k before it did."""
        tail = [sum(self.probs[n:]) for n in range(len(self.probs))]  # P(n >= i)
        return [tail[k + 2] / tail[k + 1] if tail[k + 1] > 0 else 0.0 for k in range(self.gamma)]

    def sampler(self, device: torch.device):
        """draw(num_rows) -> int64 [num_rows] tokens each verify commits, on `device`, reproducible."""
        generator = torch.Generator(device=device).manual_seed(self.seed)
        probs = torch.tensor(self.probs, dtype=torch.float32, device=device)

        def draw(num_rows: int) -> torch.Tensor:
            return torch.multinomial(probs, num_rows, replacement=True, generator=generator)

        return draw

    def describe(self) -> dict:
        return {"accept_len_mean": round(self.mean, 3), "accept_len_probs": [round(p, 4) for p in self.probs]}
