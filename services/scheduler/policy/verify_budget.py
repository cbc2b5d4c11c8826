"""`compact`: how many drafts each request verifies (the DSpark paper's scheduler, Alg. 1).

Verifying draft k of request b adds s_bk = c_b1 * ... * c_bk expected tokens (its prefix survival,
from the calibrated confidence head) and one row to the step, and a step of T tokens costs t(T)
(`StepCost`, measured). A step's rate is

    (num_outputs + sum of the chosen s) / t(num_query_tokens + number of chosen rows),

num_outputs the tokens the step commits without any draft (one per sampling sequence). s_bk never
grows along k, so for every count E of rows the best E are the E highest survivals, a prefix of
each request: the optimum is the best E (`best_lengths`), every row whose survival reaches a
threshold lambda between the E-th and the (E + 1)-th highest.

Lossless only if the cut does not depend on the draft it cuts. This step's rows are chosen with the
lambda of the previous step's optimum (lagged): request b verifies draft k iff s_bk >= lambda, and
s_bk depends on d_1 .. d_{k-1} only (c_k sees the previous token, not its own), so the cut is a
stopping time of the draft. Taking lambda from this block's own survivals would let d_k move its
own cut (through s_{k+1}). The first step, with no lambda yet, verifies every draft.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def survivals(confidences: Sequence[float]) -> list[float]:
    out, survival = [], 1.0
    for confidence in confidences:
        survival *= min(max(confidence, 0.0), 1.0)
        out.append(survival)
    return out


def best_lengths(
    survival: Sequence[Sequence[float]], step_cost: Callable[[int], float], num_query_tokens: int, num_outputs: int
) -> tuple[list[int], float]:
    """Per request, the drafts to verify that maximise expected tokens per second, and the lambda
    that picks them (`survival[b]`: request b's prefix survivals, non-increasing)."""
    ranked = sorted(((s, b) for b, row in enumerate(survival) for s in row), key=lambda x: -x[0])
    best_rate, best_rows, gained = num_outputs / step_cost(num_query_tokens), 0, 0.0
    for rows, (s, _) in enumerate(ranked, start=1):
        gained += s
        rate = (num_outputs + gained) / step_cost(num_query_tokens + rows)
        if rate > best_rate:
            best_rate, best_rows = rate, rows
    lengths = [0] * len(survival)
    for _, b in ranked[:best_rows]:
        lengths[b] += 1
    above = ranked[best_rows - 1][0] if best_rows else 1.0
    below = ranked[best_rows][0] if best_rows < len(ranked) else 0.0
    return lengths, (above + below) / 2


class VerifyBudget:
    """The lagged lambda: `num_to_verify` cuts this step's blocks by it, `observe` sets the next one."""

    def __init__(self, step_cost: Callable[[int], float]) -> None:
        self.step_cost = step_cost
        self.threshold = 0.0

    def num_to_verify(self, confidences: Sequence[float], num_drafts: int) -> int:
        """The longest prefix of the block whose survival reaches lambda."""
        return sum(1 for s in survivals(confidences[:num_drafts]) if s >= self.threshold)

    def observe(self, confidences: Sequence[Sequence[float]], num_query_tokens: int, num_outputs: int) -> None:
        """This step's blocks (their confidences), committed query tokens and outputs -> the next lambda."""
        if confidences:
            _, self.threshold = best_lengths([survivals(c) for c in confidences], self.step_cost, num_query_tokens, num_outputs)
