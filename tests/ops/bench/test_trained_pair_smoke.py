"""`sparkwire bench trained-pair` (ops/bench/trained_pair.py) at the toy recipe on the CPU: the pair
trained from a small corpus, its accept length, plain against DSpark with the same greedy ids."""

from __future__ import annotations

import json

import pytest

from ops.bench.accept_replay import AcceptReplay
from ops.train.corpus import build_manifest, collect, write_corpus
from tests.ops.bench.bench_cli import bench
from tests.ops.train.conftest import write_fake_stdlib


def toy_corpus(root):
    files = collect(write_fake_stdlib(root / "python3.12"))
    write_corpus(files, build_manifest(files, "3.12.test"), root / "corpus")
    return root / "corpus"


@pytest.mark.timeout(240)  # ~20 s alone; CI's 2 shared cores can take several times that
def test_toy_pair_is_trained_then_measured_with_the_same_greedy_ids(tmp_path, capsys) -> None:
    out = tmp_path / "pair.json"
    argv = ["--corpus", toy_corpus(tmp_path), "--recipe", "toy", "--target-steps", "2", "--device", "cpu", "--batches", "1", "2",
            "--num-prompts", "2", "--new-tokens", "24", "--rounds", "2", "--work", tmp_path / "work", "--out", out]  # fmt: skip
    assert bench("trained-pair", *argv) == 0
    result = json.loads(out.read_text())
    target, drafter = result["target"], result["drafter"]
    assert (target["steps_run"], target["recipe_steps"], target["shorter_run"]) == (2, 4, True)  # capped, and said so
    assert (drafter["steps_run"], drafter["recipe_steps"], drafter["shorter_run"]) == (3, 3, False)
    for temperature in ("0", "1"):
        accept = result["accept"][f"temperature_{temperature}"]
        assert accept["gamma"] == 4 and 1.0 <= accept["mean_accept_length"] <= 5.0 and accept["tokens_after_first"] == 2 * 23
    for name, deterministic in (("speed", False), ("speed_deterministic", True)):
        rows = result[name]
        assert [(row["batch"], row["mode"], row["deterministic"]) for row in rows] == [
            (batch, mode, deterministic) for batch in (1, 2) for mode in ("plain", "dspark")]  # fmt: skip
        assert all(row["tok_s"] > 0 and row["rounds_same_ids"] and len(row["rounds_tok_s"]) == 2 for row in rows)
        for row in rows[1::2]:  # fp32 on the CPU: DSpark's greedy ids are plain's, mode on or off
            assert row["identical"] and row["same_tokens_as_plain"] == 1.0 and row["first_difference"] == []
            assert 1.0 <= row["accept_len"] <= 5.0 and row["speedup"] > 0
    dspark = [row["accept_length_counts"] for row in result["speed"][1::2]]
    assert result["accept_length_counts"] == [sum(column) for column in zip(*dspark)] and sum(result["accept_length_counts"]) > 0
    assert AcceptReplay.load(out, gamma=4).gamma == 4  # what gpu-core --speedup --accept-lengths replays
    assert "| True | 2 |" in capsys.readouterr().out


def test_a_budget_spent_before_training_still_writes_the_json(tmp_path) -> None:
    out = tmp_path / "pair.json"
    argv = ["--corpus", tmp_path / "no-corpus", "--recipe", "toy", "--device", "cpu", "--budget-s", "10", "--measure-s", "60",
            "--work", tmp_path / "work", "--out", out]  # fmt: skip
    assert bench("trained-pair", *argv) == 0
    result = json.loads(out.read_text())
    assert "no time left to train target" in result["target"]["error"]
    assert "drafter" not in result and "speed" not in result and "accept_length_counts" not in result
