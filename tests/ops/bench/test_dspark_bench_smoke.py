"""The DSpark benches at toy size on the CPU: `dspark-sps` (the step-cost table), `dspark-sts` (the
confidence head's temperature) and `gpu-core --speedup` (plain against DSpark static and compact,
acceptance replayed); and the replayed acceptance itself. Subprocesses, as the other smoke runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops.bench.accept_replay import AcceptReplay
from services.scheduler.spec.calibration import load_temperature
from services.scheduler.spec.step_cost import StepCost

REPO = Path(__file__).resolve().parents[3]


def bench(*argv: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "ops.bench", *argv], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_dspark_sps_profiles_a_table_the_scheduler_loads(tmp_path):
    bench("dspark-sps", "--device", "cpu", "--tiny", "--max-batch", "4", "--repeats", "2", "--context", "16",
          "--out", str(tmp_path / "sps.json"), "--save", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "sps.json").read_text())
    assert [r["tokens"] for r in result["rows"]] == [1, 2, 4, 8, 16]  # powers of two and B * (gamma + 1), gamma 3
    assert [r["seqs"] for r in result["rows"]] == [1, 1, 1, 2, 4]
    cost = StepCost.load(tmp_path)
    assert [t for t, _ in cost.points] == [1, 2, 4, 8, 16]
    assert all(a <= b for (_, a), (_, b) in zip(cost.points, cost.points[1:]))  # never cheaper with more tokens


def test_one_slow_point_of_the_sps_table_does_not_raise_the_larger_steps():
    from ops.bench.dspark_sps import step_cost
    from services.scheduler.policy.verify_budget import best_lengths, prefix_survivals

    ms = {1: 3.4, 2: 6.1, 4: 6.6, 8: 7.5, 16: 7.8, 32: 462.0, 64: 17.0, 128: 33.5, 256: 46.5}  # a CPU run's table, 32 an outlier
    cost = step_cost([{"tokens": t, "seqs": 1, "ms": v} for t, v in ms.items()])
    assert [round(1e3 * s, 1) for _, s in cost.points] == [3.4, 6.1, 6.6, 7.5, 7.8, 17.0, 17.0, 33.5, 46.5]
    lengths, _ = best_lengths(prefix_survivals([[0.79, 0.79, 0.79]] * 16), cost, 16, 16)
    assert set(lengths) == {3}  # 64 tokens at 17 ms, not 0 drafts (a running max priced 17 .. 64 tokens at 462 ms)


def test_dspark_sts_fits_and_saves_a_temperature(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    bundled = REPO / "ops/models/sparkwire-micro-dspark"
    for name in ("config.json", "model.safetensors"):
        (draft / name).symlink_to(bundled / name)
    bench("dspark-sts", "--draft", str(draft), "--num-prompts", "2", "--new-tokens", "24", "--save", "--out", str(tmp_path / "sts.json"))
    result = json.loads((tmp_path / "sts.json").read_text())
    assert result["slots"] > 100 and 0 < result["accepted_share"] < 1
    assert result["ece"] <= result["ece_at_1"]
    assert load_temperature(draft) == result["temperature"] != 1.0


def test_gpu_core_speedup_reports_plain_static_and_compact(tmp_path):
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({"accept_length_counts": [0, 1, 1, 1, 5]}))  # gamma 3: mostly every draft kept
    done = bench("gpu-core", "--device", "cpu", "--tiny", "--speedup", "--batches", "1", "2", "--prompt-len", "8",
                 "--new-tokens", "24", "--rounds", "1", "--accept-lengths", str(counts), "--out", str(tmp_path / "core.json"))  # fmt: skip
    result = json.loads((tmp_path / "core.json").read_text())
    assert result["accept_replay"]["accept_len_mean"] == pytest.approx((1 + 2 + 3 + 20) / 8, abs=1e-3)
    assert [(r["batch"], r["mode"], r["logprobs"]) for r in result["speedup"]] == [
        (b, mode, lp) for b in (1, 2) for mode, lp in (("plain", "plain"), ("plain", "top20"), ("static", "plain"),
                                                       ("static", "top20"), ("compact", "plain"))]  # fmt: skip
    for row in result["speedup"]:
        per_step = row["tokens_per_request_step"]
        assert per_step == 1.0 if row["mode"] == "plain" else 1.0 < per_step <= 4.0
        assert 0 < row["held_steps"] < row["steps"] and row["held_tokens"] == pytest.approx(row["held_steps"] * row["batch"] * row["held_tokens_per_row"])
        if row["mode"] == "plain":  # every request runs to the last step, which all of them finish in
            assert row["held_steps"] == row["steps"] - 1 and row["mean_rows"] == row["batch"]
        else:  # the replay's draws (mostly 4 tokens, never more) are what the held steps commit, not the dummy pair's
            assert 2.5 < row["held_tokens_per_row"] <= 4.0
    assert [r["batch"] for r in result["speedup_summary"]] == [1, 2]
    assert all(r["static_speedup"] > 0 and r["compact_speedup"] > 0 for r in result["speedup_summary"])
    assert all(r["static_speedup_drained"] > 0 and r["plain_tok_s_drained"] > 0 for r in result["speedup_summary"])
    assert "compact tok/s" in done.stdout.splitlines()[-4]


def test_replayed_acceptance_draws_its_distribution_and_hazards():
    replay = AcceptReplay.geometric(7)
    assert replay.mean == pytest.approx(4.04, abs=0.01)
    draws = replay.sampler(torch.device("cpu"))(200_000)
    assert draws.float().mean().item() == pytest.approx(replay.mean, abs=0.02) and int(draws.min()) >= 1
    assert replay.hazards() == pytest.approx([0.79] * 7)
    folded = AcceptReplay.from_counts([0, 2, 0, 1, 1, 4], gamma=3)  # a gamma-4 run's 5 tokens count as 4
    assert folded.probs == pytest.approx((0, 0.25, 0, 0.125, 0.625))
    assert AcceptReplay.fixed(3, 2).hazards() == [1.0, 0.0, 0.0]  # the first draft always kept, the second never


def test_a_pair_runs_counts_are_replayed(tmp_path):
    path = tmp_path / "pair.json"
    path.write_text(json.dumps({"pair": [{"mode": "plain"}, {"mode": "dspark", "accept_length_counts": [0, 1, 3]},
                                         {"mode": "dspark", "accept_length_counts": [0, 1, 1]}]}))  # fmt: skip
    assert AcceptReplay.load(path, gamma=1).probs == pytest.approx((0, 2 / 6, 4 / 6))
    path.write_text("{}")
    with pytest.raises(ValueError, match="no accept_length_counts"):
        AcceptReplay.load(path, gamma=1)


@pytest.mark.timeout(240)
def test_dspark_serve_runs_plain_and_compact_through_the_stack(tmp_path):
    out = tmp_path / "serve.json"
    done = bench("dspark-serve", "--device", "cpu", "--model-config", "ops/models/sparkwire-micro", "--draft-model",
                 "ops/models/sparkwire-micro-dspark", "--concurrency", "1", "--prompts-per-level", "2", "--output-len", "6",
                 "--modes", "plain", "compact", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert "error" not in result
    assert [(r["mode"], r["concurrency"], r["completed"], r["failed"]) for r in result["rows"]] == [
        (mode, 1, 2, 0) for mode in ("plain", "compact")]
    assert result["summary"][0]["compact_speedup"] > 0 and "compact tok/s" in done.stdout
    assert "DSparkDrafter" in (tmp_path / "dspark_serve_logs" / "scheduler-compact.log").read_text()


def test_dspark_serve_compares_no_level_where_requests_failed():
    from ops.bench.dspark_serve import summary_rows, table

    rows = [{"mode": "plain", "concurrency": 64, "output_throughput": 5981.0, "failed": 0},
            {"mode": "static", "concurrency": 64, "output_throughput": 2.9, "failed": 188},
            {"mode": "compact", "concurrency": 64, "output_throughput": 7000.0, "failed": 0}]  # fmt: skip
    (summary,) = summary_rows(rows)
    assert summary["static_speedup"] is None and summary["compact_speedup"] == pytest.approx(7000 / 5981)
    assert summary["failed"] == {"static": 188}
    assert "static: 188 failed" in table({"accept_replay": "x", "summary": [summary]})


def test_startup_memory_accounts_for_every_byte_the_tiny_pair_allocates_on_the_cpu(tmp_path):
    """The CPU twin of the start-up ledger: with nothing else alive in the process, the weights and
    KV caches are everything allocated (on CUDA the rest, if any, is listed by allocation site)."""
    bench("startup-memory", "--device", "cpu", "--tiny", "--mode", "static", "--out", str(tmp_path / "memory.json"))
    result = json.loads((tmp_path / "memory.json").read_text())
    assert [r["stage"] for r in result["stages"]] == ["load_runner", "load_proposer", "resolve", "prepare_runtime", "assemble_core"]
    assert result["kv_cache_memory_fraction"] == 0.6  # a drafter's default
    ledger = result["ledger_gib"]
    assert set(ledger) == {"target_weights", "target_kv_cache", "drafter_weights", "drafter_kv_cache"}
    assert result["stages"][1]["allocated_gib"] > result["stages"][0]["allocated_gib"]  # the drafter and its cache
    assert abs(result["unnamed_gib"]) < 0.002 and "error" not in result
