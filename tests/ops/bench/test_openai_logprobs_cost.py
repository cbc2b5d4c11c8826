"""`ops/bench/openai_logprobs_cost.py` at toy size, against this same checkout as --before: both
trees are timed, in two processes, and their JSON must agree byte for byte."""

from __future__ import annotations

import argparse
from pathlib import Path

from ops.bench.openai_logprobs_cost import run

REPO = Path(__file__).resolve().parents[3]


def test_both_trees_are_timed_and_agree(tmp_path):
    result = run(argparse.Namespace(top_k=[3], tokens=[1, 4], repeats=3, before=REPO, out=tmp_path / "cost.json", null_first=False, heap=0))
    assert list(result["trees"]) == ["before", "this"] and result["same_json"] is True
    for rows in result["trees"].values():
        assert [(r["format"], r["tokens"]) for r in rows] == [(f, n) for n in (1, 4) for f in ("completion", "chat", "generate")]
        assert all(r["us_per_token"] > 0 for r in rows)
    assert (tmp_path / "cost.json").is_file()


def test_a_null_first_position_as_a_prompt_has_is_timed_too(tmp_path):
    result = run(argparse.Namespace(top_k=[2], tokens=[16], repeats=2, before=REPO, out=tmp_path / "cost.json", null_first=True, heap=1000))
    assert result["same_json"] is True and all(r["us_per_token"] > 0 for rows in result["trees"].values() for r in rows)
