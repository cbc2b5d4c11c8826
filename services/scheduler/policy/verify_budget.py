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

from collections.abc import Sequence

import numpy as np

from services.scheduler.spec.step_cost import StepCost


def prefix_survivals(confidences: Sequence[Sequence[float]]) -> np.ndarray:
    """Each block's confidences -> float64 [B, gamma] prefix survivals (0 past a shorter block's end)."""
    width = max(map(len, confidences), default=0)
    if all(len(row) == width for row in confidences):
        padded = np.asarray(confidences, dtype=np.float64).reshape(len(confidences), width)
    else:
        padded = np.zeros((len(confidences), width))
        for row, values in zip(padded, confidences):
            row[: len(values)] = values
    return np.cumprod(np.clip(padded, 0.0, 1.0), axis=1)


def best_lengths(survival: np.ndarray, step_cost: StepCost, num_query_tokens: int, num_outputs: int) -> tuple[list[int], float]:
    """survival float64 [B, gamma] (each row non-increasing) -> the drafts each request verifies to
    maximise expected tokens per second, and the lambda that picks them."""
    flat = survival.ravel()  # [B * gamma]
    order = np.argsort(-flat, kind="stable")  # ties: request order, then position: prefixes stay prefixes
    ranked = flat[order]
    gained = np.concatenate(([0.0], np.cumsum(ranked)))  # [N + 1]: expected tokens of the best E rows
    rates = (num_outputs + gained) / step_cost.many(num_query_tokens + np.arange(len(ranked) + 1))
    rows = int(np.argmax(rates))  # the fewest rows among equal rates
    lengths = np.bincount(order[:rows] // max(survival.shape[1], 1), minlength=survival.shape[0]).tolist()
    above = ranked[rows - 1] if rows else 1.0
    below = ranked[rows] if rows < len(ranked) else 0.0
    return lengths, float(above + below) / 2


class VerifyBudget:
    """The lagged lambda: `num_to_verify` cuts this step's blocks by it, `observe` sets the next one."""

    def __init__(self, step_cost: StepCost) -> None:
        self.step_cost = step_cost
        self.threshold = 0.0

    def num_to_verify(self, confidences: Sequence[float], num_drafts: int) -> int:
        """The longest prefix of the block whose survival reaches lambda."""
        count, survival = 0, 1.0
        for confidence in confidences[:num_drafts]:
            survival *= min(max(confidence, 0.0), 1.0)
            if survival < self.threshold:
                break
            count += 1
        return count

    def observe(self, confidences: Sequence[Sequence[float]], num_query_tokens: int, num_outputs: int) -> None:
        """This step's blocks (their confidences), committed query tokens and outputs -> the next lambda."""
        if confidences:
            survival = prefix_survivals(confidences)
            _, self.threshold = best_lengths(survival, self.step_cost, num_query_tokens, num_outputs)
