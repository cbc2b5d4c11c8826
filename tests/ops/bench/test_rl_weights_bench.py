"""`sparkwire bench rl-weights` (ops/bench/rl_weights.py) on CPU with the bundled model, so the GPU
run cannot rot: every phase runs, and the dummy-weight writer makes a checkpoint the loader takes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ops.bench.rl_weights import write_dummy_weights
from services.models import RANDOM_TINY_MODEL
from services.scheduler.model import load_model_runner
from tests.ops.bench.bench_cli import bench


@pytest.mark.timeout(300)
def test_every_phase_runs_on_the_bundled_model(tmp_path):
    out = tmp_path / "rl.json"
    assert bench("rl-weights", "--device", "cpu", "--tiny", "--budget-s", 250, "--out", out) == 0
    result = json.loads(out.read_text())
    assert result["skipped"] == [] and result["restart_s"] > 0
    for kind in ("disk", "nats"):
        assert 0 < result[kind]["update_s"] and result[kind]["vs_restart"] > 0
    assert result["nats"]["bytes"] > 0.9 * result["weight_bytes"]  # every tensor went over NATS
    assert result["nats"]["steady_update_s"] > 0  # pushed twice: the second into the staging of the first
    for prefix in ("", "steady_"):  # each push's time split: the pieces' travel, then the scheduler's commit (its reply)
        nats = result["nats"]
        assert 0 < nats[prefix + "commit_s"] < nats[prefix + "update_s"]
        assert nats[prefix + "pieces_s"] + nats[prefix + "commit_s"] == pytest.approx(nats[prefix + "update_s"])
    assert all(result[k] > 0 for k in ("ttft_after_restart_s", "ttft_after_disk_s", "ttft_after_nats_s", "ttft_after_resume_s"))
    assert result["memory"]["resume_s"] > 0


@pytest.mark.timeout(120)
def test_nats_only_pushes_into_a_receiver_process_without_a_model(tmp_path):
    out = tmp_path / "nats.json"
    assert bench("rl-weights", "--nats-only", 0.1, "--out", out) == 0
    result = json.loads(out.read_text())
    assert len(result["pushes"]) == 3 and all(push["gb_per_s"] > 0 and push["swap_s"] > 0 for push in result["pushes"])
    assert set(result["cpu_s_per_gb"]) == {"pusher", "receiver", "nats-server"}


@pytest.mark.timeout(200)
def test_into_scheduler_pushes_whole_versions_into_the_receiver_and_a_real_scheduler_under_py_spy(tmp_path):
    out = tmp_path / "intake.json"
    spy = tmp_path / "spy.txt"
    assert bench("rl-weights", "--nats-only", 0.05, "--into-scheduler", "cpu", "--rounds", 2, "--profile-scheduler", spy, "--out", out) == 0
    result = json.loads(out.read_text())
    profile = result["scheduler_profile"]  # py-spy read the scheduler over the pushes and wrote its samples
    assert "error" not in profile and spy.is_file() and 0 <= profile["gil_held_share"] <= 1
    assert {name: len(runs) for name, runs in result["seconds"].items()} == {"receiver": 2, "scheduler": 2}
    assert all(rate > 0 for rates in result["gb_per_s"].values() for rate in rates)
    # the scheduler took every piece: its commit got past the completeness check to comparing with its model
    assert len(result["refusals"]) == 2 and all("the served model" in r or "missing from the new weights" in r for r in result["refusals"])


def test_dummy_weights_are_a_checkpoint_the_loader_takes(tmp_path, monkeypatch):
    monkeypatch.setattr("ops.bench.rl_weights.SHARD_BYTES", 1 << 20)  # several shards
    model_dir = tmp_path / "model"
    shutil.copytree(RANDOM_TINY_MODEL, model_dir)
    written = write_dummy_weights(model_dir)
    assert len(list(model_dir.glob("*.safetensors"))) > 1
    runner = load_model_runner(model_dir, dtype=torch.bfloat16, num_kv_blocks=4)
    assert written == sum(2 * t.numel() for _, t in runner.model.checkpoint_tensors())
    assert runner.model.model.norm.weight.abs().sum() > 0
