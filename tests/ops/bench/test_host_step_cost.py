"""The host-cost benchmark (ops/bench/host_step_cost.py) times every piece it names and leaves the core as it found it."""

from __future__ import annotations

import pytest
import torch

from ops.bench import host_step_cost
from services.models import RANDOM_TINY_MODEL
from services.scheduler.model import load_model_runner


@pytest.fixture(scope="module")
def runner():
    return load_model_runner(RANDOM_TINY_MODEL, device="cpu", dtype=torch.float32, num_kv_blocks=256, kv_block_size=16)


def test_every_piece_is_timed_on_decode_steps_and_the_wrappers_come_off(runner):
    originals = {(owner, name): getattr(owner, name) for targets in host_step_cost.PIECES.values() for owner, name in targets}
    row = host_step_cost.measure(runner, 3, "top20_ids", new_tokens=8)
    assert row["steps"] == 4  # 8 tokens: the prefill's and 3 warm steps' first 4, then 4 decode steps timed
    assert all(row[f"{piece}_us"] > 0 for piece in host_step_cost.HOST_PIECES)
    assert row["payload_bytes"] > 0
    assert all(getattr(owner, name) is original for (owner, name), original in originals.items())


def test_served_paths_take_greedy_steps_through_the_logprob_graphs_twin(runner, monkeypatch):
    """`--served-paths`: decode steps on the decode graphs' twin and their tokens and top-20 rows from
    `LogprobGraphs.greedy`, whose registering for the readback the readback piece times."""
    from services.scheduler.worker.readback import StepParts

    taken = []
    original = StepParts.greedy
    monkeypatch.setattr(StepParts, "greedy", lambda self, found: taken.append(found) or original(self, found))
    runner.prepare_decode_graphs(max_blocks_per_seq=4, capture=False)
    try:
        row = host_step_cost.measure(runner, 3, "top20", new_tokens=8, served_paths=True)
    finally:
        runner.drop_decode_graphs()
    assert row["steps"] == 4 and row["readback_us"] > 0
    assert len(taken) >= 4  # the 4 timed decode steps at least (warm ones too)


def test_churn_times_each_kind_of_step_of_a_batch_that_changes(runner):
    """`--churn`: short requests replaced as they finish give steady decodes, finishes and arrivals'
    mixed steps, each kind's pieces timed (the batch's first 20 steps left out)."""
    rows = host_step_cost.measure_churn(runner, "top20", num_steps=80, batch=6, lengths=(3, 9), prompt_len=8)
    assert [row["logprobs"] for row in rows] == [f"top20, {group}" for group in host_step_cost.CHURN_GROUPS]
    assert all(row["steps"] > 0 and row["host_us"] > 0 and row["update_us"] > 0 for row in rows), rows
    assert sum(row["steps"] for row in rows) <= 80 - 20
    assert "top20, mixed+finish" in host_step_cost.table(rows)


def test_best_of_takes_each_figure_from_its_least_disturbed_round():
    rounds = [{"rows": [{"batch": 1, "host_us": 5.0, "wire_us": 1.0}]}, {"rows": [{"batch": 1, "host_us": 4.0, "wire_us": 2.0}]}]
    assert host_step_cost.best_of(rounds)["rows"] == [{"batch": 1, "host_us": 4.0, "wire_us": 1.0}]
