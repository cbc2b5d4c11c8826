"""`sparkwire bench grammar-overhead` (ops/bench/grammar_overhead.py) runs, on a tiny shape."""

from __future__ import annotations

import json

from services.models import RANDOM_TINY_MODEL
from tests.ops.bench.bench_cli import bench


def test_grammar_overhead_writes_every_row_and_prints_its_table(tmp_path, capsys):
    out = tmp_path / "grammar.json"
    argv = ["grammar-overhead", "--model", RANDOM_TINY_MODEL, "--batches", 1, 3, "--widths", 1, 4, "--repeats", 2, "--steps", 2]
    assert bench(*argv, "--out", out) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(row["batch"], row["width"]) for row in rows] == [(1, 1), (1, 4), (3, 1), (3, 4)]
    assert all(row["fill_us"] > 0 and row["apply_us"] > 0 for row in rows)
    assert all("step_overhead_us" in row for row in rows if row["width"] == 1)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| 3 | 4 |")
