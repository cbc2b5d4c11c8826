"""`sparkwire bench lm-eval-cache`: its task is the same on every machine, and (where lm-eval is
installed: the `eval` extra, which CI does not install) lm-eval's scores through the stack are the
same with the prefix cache on and off, the cache-on stack finding the shared few-shot context."""

from __future__ import annotations

import json
import random

import pytest

from ops.bench.lm_eval_cache import EvalCheck, idiom, items, write_task
from tests.ops.bench.bench_cli import bench


def test_the_items_are_deterministic_and_their_labels_name_the_right_continuation():
    docs = items(40, seed=3)
    assert docs == items(40, seed=3) and docs != items(40, seed=4)
    rng = random.Random(3)
    for doc in docs:
        context, choices = idiom(rng)
        rng.sample(range(len(choices)), len(choices))  # the shuffle `items` draws
        assert doc["context"] == context and doc["choices"][doc["label"]] == choices[0]
    assert len({doc["label"] for doc in docs}) == 4  # the right one is not always in one place


def test_the_task_file_reads_the_written_splits(tmp_path):
    task_dir = write_task(EvalCheck(items=5, fewshot=2), tmp_path)
    task = json.loads((task_dir / "python-idioms.yaml").read_text())
    assert task["num_fewshot"] == 2 and task["fewshot_config"] == {"sampler": "first_n"}  # one context shared by all
    lines = {split: (task_dir / f"{split}.jsonl").read_text().splitlines() for split in ("train", "test")}
    assert [len(lines["train"]), len(lines["test"])] == [2, 5]
    assert task["dataset_kwargs"]["data_files"]["test"] == str(task_dir / "test.jsonl")


@pytest.mark.timeout(300)
def test_scores_are_identical_with_the_cache_on_and_off(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    out = tmp_path / "lm_eval.json"
    assert bench("lm-eval-cache", "--items", 6, "--fewshot", 3, "--num-concurrent", 2, "--out", out) == 0
    result = json.loads(out.read_text())
    assert result["summary"]["scores_identical"] and result["summary"]["choices_scored"] == 24
    assert result["on"]["prefix_cache"]["hits"] > 0 and result["off"]["prefix_cache"]["hits"] == 0
    assert result["on"]["prefix_cache"]["queries"] == result["off"]["prefix_cache"]["queries"]
    assert "scores_identical: True" in capsys.readouterr().out
