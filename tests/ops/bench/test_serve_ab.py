"""`sparkwire bench gpu-serve-ab` (ops/bench/serve_ab.py): the run order, the figures and their summary against a committed call
whose figures were worked out by hand (gpu_serve.md, 0.6B run 48; the call's JSON kept here as data), and a toy-size run of two trees
through the launched stack on CPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ops.bench import serve_ab
from ops.bench.serve_ab import alternating, scenario_figures, summarize
from services.models import BUNDLED_MODEL
from tests.ops.bench.bench_cli import bench

REPO = Path(__file__).resolve().parents[3]
RUN_48 = Path(__file__).parent / "data/serve_ab_run48.json"  # {"r{round}_{tree}.json": a gpu_serve_check result}


def test_the_trees_alternate_so_each_round_reverses_the_last():
    assert alternating(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert alternating(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]


def test_run_48_summarized_as_its_section_says():
    runs = []
    for name, result in json.loads(RUN_48.read_text()).items():
        round_index, tree = re.fullmatch(r"r(\d)_(\w+)\.json", name).groups()
        runs.append({"round": int(round_index), "tree": tree, "scenarios": {k: scenario_figures(s) for k, s in result["scenarios"].items()}})
    summary = summarize(sorted(runs, key=lambda run: run["round"]))
    after, before = summary["after"], summary["before"]
    assert after["rounds"] == before["rounds"] == 4
    cost = after["top20_cost"]["concurrency"]
    assert [round(100 * c, 2) for c in cost["rounds"]] == [-3.78, -4.9, -4.56, -4.35]
    assert round(100 * cost["of_summed_tok_s"], 2) == -4.4 and round(100 * before["top20_cost"]["concurrency"]["of_summed_tok_s"], 2) == -4.12
    top20 = after["scenarios"]["concurrency_logprobs"]
    assert round(top20["tok_s"]["mean"]) == 25873 and (round(top20["decode_ms"]["min"], 3), round(top20["decode_ms"]["max"], 3)) == (1.893, 1.905)
    plain = after["scenarios"]["concurrency"]  # its traces predate between_steps_s: span less steps and turns
    assert (round(plain["between_steps_ms"]["min"], 3), round(plain["between_steps_ms"]["max"], 3)) == (0.172, 0.19)
    assert 61.1 < plain["decode_batch"]["min"] < plain["decode_batch"]["max"] < 61.8
    assert "batch1" not in after["top20_cost"]  # no batch-1 pair in this call


def test_a_failed_scenario_is_kept_and_left_out_of_the_means():
    assert scenario_figures({"error": "boom"}) == {"error": "boom"}
    ok = {"tok_s": 100.0, "ttft_p50_ms": 1.0, "itl_p50_ms": 1.0}
    runs = [{"tree": "a", "scenarios": {"concurrency": ok, "concurrency_logprobs": {**ok, "tok_s": 95.0}}},
            {"tree": "a", "scenarios": {"concurrency": ok, "concurrency_logprobs": {"error": "boom"}}}]  # fmt: skip
    summary = summarize(runs)["a"]
    assert summary["scenarios"]["concurrency_logprobs"]["tok_s"]["mean"] == 95.0
    assert summary["top20_cost"]["concurrency"]["rounds"] == [pytest.approx(-0.05)]  # the failed round has no cost


@pytest.mark.timeout(300)
def test_two_trees_served_at_toy_size(tmp_path, capsys):
    out = tmp_path / "ab.json"
    check = ["--device", "cpu", "--model-config", str(BUNDLED_MODEL), "--concurrency", "2", "--num-prompts", "4", "--input-len", "8",
             "--output-len", "4", "--num-warmups", "1", "--no-core-baseline", "--scenarios", "concurrency", "concurrency_logprobs"]  # fmt: skip
    assert bench("gpu-serve-ab", "--tree", f"a={REPO}", "--tree", f"b={REPO}", "--rounds", "1", "--out", out, "--", *check) == 0
    result = json.loads(out.read_text())
    assert [(run["round"], run["tree"]) for run in result["runs"]] == [(0, "a"), (0, "b")]
    for tree in ("a", "b"):
        summary = result["summary"][tree]
        assert summary["scenarios"]["concurrency"]["tok_s"]["mean"] > 0 and len(summary["top20_cost"]["concurrency"]["rounds"]) == 1
        assert summary["scenarios"]["concurrency_logprobs"]["decode_batch"]["mean"] > 0  # from the step trace
        assert summary["scenarios"]["concurrency"]["client_ms"]["mean"] >= 0  # the closed loop's turnaround
    assert not any(_keys_named("requests", run["result"]) for run in result["runs"])  # kept without per-request lists
    assert "| a | concurrency_logprobs | 1 |" in capsys.readouterr().out


def _keys_named(name: str, value) -> bool:
    if isinstance(value, dict):
        return name in value or any(_keys_named(name, v) for v in value.values())
    return isinstance(value, list) and any(_keys_named(name, v) for v in value)


def test_each_run_is_written_out_before_the_next_begins(tmp_path, monkeypatch):
    """A call cut short by its time limit keeps the rounds it finished."""
    out, seen = tmp_path / "ab.json", []

    def fake_run(tree, check_args, run_out):
        seen.append([run["tree"] for run in json.loads(out.read_text())["runs"]] if out.exists() else [])
        return {"scenarios": {"concurrency": {"output_throughput": 100.0 + len(seen), "ttft_ms": {"p50": 1.0}, "itl_ms": {"p50": 1.0}}}}

    monkeypatch.setattr(serve_ab, "run_tree", fake_run)
    assert bench("gpu-serve-ab", "--tree", f"a={REPO}", "--tree", f"b={REPO}", "--rounds", "2", "--out", out) == 0
    assert seen == [[], ["a"], ["a", "b"], ["a", "b", "b"]]
    assert json.loads(out.read_text())["summary"]["a"]["scenarios"]["concurrency"]["tok_s"]["mean"] == 102.5  # runs 1 and 4
