"""What output logprobs add to a step (ops/bench/logprob_ops.py): a fixed set of kernels, whatever the batch."""

from __future__ import annotations

import json

import pytest
import torch

from ops.bench.logprob_ops import count_step
from tests.ops.bench.bench_cli import bench
from services.models import RANDOM_TINY_MODEL
from services.scheduler.model import load_model_runner

# One pass over all of the step's rows: log_softmax, the targets' gather, top_k_sorted (topk, eq,
# where, gt, where, topk, gather, sort, gather) and the int32 cast of its ids.
TOP_K_KERNELS = 1 + 1 + 9 + 1
# Some requests not asking: their rows are indexed out of the logits and of the sampled tokens; and the
# requested ids' gather.
MIXED_KERNELS = TOP_K_KERNELS + 2 + 1
PROCESSED_KERNELS = TOP_K_KERNELS + 1  # the floor (clamp); greedy requests without filters need no more


@pytest.fixture(scope="module")
def runner():
    return load_model_runner(RANDOM_TINY_MODEL, device="cpu", dtype=torch.float32, num_kv_blocks=256, kv_block_size=16)


def added(runner, kind: str, batch: int, logprobs: str, mode: str = "raw") -> tuple[int, int]:
    """(ops, kernels) of one step with these logprobs, less those of the same step without."""
    with_lp, without = (count_step(runner, kind, batch, lp, mode) for lp in (logprobs, "none"))
    return with_lp["ops"] - without["ops"], with_lp["kernels"] - without["kernels"]


@pytest.mark.parametrize("kind", ["plain", "dspark"])
def test_output_logprobs_add_the_same_few_kernels_for_any_number_of_requests(runner, kind):
    top20 = {added(runner, kind, b, "top20") for b in (1, 6)}
    mixed = {added(runner, kind, b, "mixed") for b in (2, 6)}
    assert len(top20) == len(mixed) == 1  # nothing per request: not a kernel, not even a view
    assert top20.pop()[1] <= TOP_K_KERNELS and mixed.pop()[1] <= MIXED_KERNELS
    assert added(runner, kind, 6, "top20", "processed")[1] <= PROCESSED_KERNELS


def test_the_command_writes_every_step_kind_and_setting(tmp_path):
    out = tmp_path / "ops.json"
    assert bench("logprob-ops", "--batches", 1, "--out", out) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["step"], r["logprobs"], r["mode"]) for r in rows] == [
        (step, lp, mode) for step in ("plain", "dspark") for lp, mode in (("top20", "raw"), ("top20", "processed"), ("mixed", "raw"))]
    assert all(0 < r["added_kernels"] <= r["kernels"] for r in rows)
