"""`sparkwire bench host-context` (ops/bench/host_context_cost.py) at a tiny size: every context is measured with every sequence
decoding in every timed step (the script asserts it), and the block ids a step reads follow the context."""

from __future__ import annotations

import json

from tests.ops.bench.bench_cli import bench


def test_host_context_cost_measures_each_context(tmp_path) -> None:
    out = tmp_path / "cost.json"
    assert bench("host-context", "--contexts", "32", "700", "--batch", "3", "--steps", "4", "--repeats", "2", "--out", out) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["batch"], r["block_ids_per_step"]) for r in rows] == [(32, 3, 6), (700, 3, 132)]
    assert all(r["ms_per_step"] > 0 and len(r["ms_per_step_all"]) == 2 for r in rows)
