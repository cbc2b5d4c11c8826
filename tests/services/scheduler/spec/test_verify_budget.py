"""`compact`'s verify budget: the chosen lengths against a brute-force optimum; the lagged lambda;
the measured step cost and the confidence calibration it reads."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch

from services.scheduler.policy.verify_budget import VerifyBudget, best_lengths, prefix_survivals
from services.scheduler.spec.calibration import expected_calibration_error, fit_temperature, load_temperature, save_temperature
from services.scheduler.spec.step_cost import DEFAULT_POINTS, SPS_FILE, StepCost


def rate(lengths, survival, cost, num_query_tokens, num_outputs) -> float:
    gained = sum(sum(row[:n]) for row, n in zip(survival, lengths))
    return (num_outputs + gained) / cost(num_query_tokens + sum(lengths))


COSTS = {
    "flat then linear": StepCost(((1, 1.0), (6, 1.0), (30, 5.0))),
    "linear": StepCost(((1, 1.0), (2, 1.4))),
    "steep": StepCost(((1, 1.0), (3, 1.1), (4, 3.0))),
    "default": StepCost(),
}


@pytest.mark.parametrize("cost_name", sorted(COSTS))
@pytest.mark.parametrize("seed", range(6))
def test_the_chosen_lengths_reach_the_brute_force_optimum(cost_name, seed):
    cost, rng = COSTS[cost_name], random.Random(seed)
    batch, gamma = rng.randint(1, 3), rng.randint(1, 4)
    survival = prefix_survivals([[rng.random() ** 0.3 for _ in range(gamma)] for _ in range(batch)]).tolist()
    num_query_tokens, num_outputs = batch + rng.randint(0, 3), batch + rng.randint(0, 1)
    lengths, threshold = best_lengths(np.asarray(survival), cost, num_query_tokens, num_outputs)
    best = max(rate(c, survival, cost, num_query_tokens, num_outputs) for c in itertools.product(range(gamma + 1), repeat=batch))
    assert rate(lengths, survival, cost, num_query_tokens, num_outputs) == pytest.approx(best, rel=1e-12)
    # lambda picks exactly the chosen prefixes
    assert [sum(s >= threshold for s in row) for row in survival] == lengths


def test_free_rows_verify_everything_and_dear_rows_nothing():
    survival = prefix_survivals([[0.9, 0.5, 0.2]])
    assert best_lengths(survival, StepCost(((1, 1.0),)), 1, 1)[0] == [3]
    assert best_lengths(survival, StepCost(((1, 1.0), (2, 2.0))), 1, 1)[0] == [0]  # each row costs a whole step
    # t(T) = 1 + T/2 from 1 query token: E=0 -> 1/1.5, E=1 -> 1.9/2, E=2 -> 2.35/2.5
    assert best_lengths(prefix_survivals([[0.9, 0.5]]), StepCost(((1, 1.0), (2, 1.5))), 1, 1)[0] == [1]
    assert prefix_survivals([[0.5, 0.5], [0.5]]).tolist() == [[0.5, 0.25], [0.5, 0.0]]  # a short block ends at 0


def test_the_budget_cuts_with_the_previous_steps_lambda():
    budget = VerifyBudget(StepCost(((1, 1.0), (3, 1.0), (4, 10.0))))
    assert budget.num_to_verify([0.1, 0.1, 0.1], 3) == 3  # no lambda yet: the whole block
    budget.observe([[0.9, 0.9, 0.9], [0.2, 0.9, 0.9]], num_query_tokens=2, num_outputs=2)  # the next step has room for 1 row
    assert 0.2 < budget.threshold <= 0.9
    assert budget.num_to_verify([0.95, 0.5, 0.99], 3) == 1
    assert budget.num_to_verify([0.95, 0.99, 0.99], 2) == 2


def test_step_cost_interpolates_extrapolates_and_round_trips(tmp_path):
    cost = StepCost(((4, 1.0), (8, 2.0), (16, 2.0)))
    assert [cost(t) for t in (1, 4, 6, 8, 12, 16, 32)] == [1.0, 1.0, 1.5, 2.0, 2.0, 2.0, 2.0]
    assert StepCost(((1, 1.0), (3, 2.0)))(7) == 4.0  # past the last point: the last slope
    assert cost.many(np.array([1, 4, 6, 8, 12, 16, 32])).tolist() == [cost(t) for t in (1, 4, 6, 8, 12, 16, 32)]
    assert StepCost(((1, 1.0), (3, 2.0))).many(np.array([7, 0])).tolist() == [4.0, 1.0]
    assert StepCost.load(tmp_path).points == DEFAULT_POINTS
    cost.save(tmp_path / SPS_FILE, device="cpu")
    assert StepCost.load(tmp_path) == cost and json.loads((tmp_path / SPS_FILE).read_text())["device"] == "cpu"
    with pytest.raises(ValueError, match="strictly increasing"):
        StepCost(((4, 1.0), (4, 2.0)))


def test_temperature_scaling_recovers_an_overconfident_head(tmp_path):
    generator = torch.Generator().manual_seed(0)
    true_logits = torch.randn(20_000, generator=generator) * 1.5
    outcomes = torch.bernoulli(true_logits.sigmoid(), generator=generator)
    overconfident = true_logits * 3.0  # a head three times too sure
    tau, ece = fit_temperature(overconfident, outcomes)
    assert 2.5 < tau < 3.6 and ece < 0.02
    assert expected_calibration_error(overconfident.sigmoid(), outcomes) > 3 * ece
    assert load_temperature(tmp_path) == 1.0
    save_temperature(tmp_path, tau, ece=ece)
    assert load_temperature(tmp_path) == tau
