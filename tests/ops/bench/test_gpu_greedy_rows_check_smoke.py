"""ops/bench/gpu_greedy_rows_check.py on the CPU (tiny model, the decode graphs' and logprob graphs'
twins): both paths give the same tokens and logprobs, and only the greedy path's decode steps are
read back without a concatenation."""

from __future__ import annotations

import json

from ops.bench import gpu_greedy_rows_check


def test_greedy_rows_check_agrees_and_counts_the_joined_readbacks(tmp_path) -> None:
    out = tmp_path / "greedy.json"
    assert gpu_greedy_rows_check.main(["--device", "cpu", "--batches", "1", "3", "--rounds", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["logprobs"], r["batch"]) for r in rows] == [("top20", 1), ("top20", 3), ("top5_ids4", 1), ("top5_ids4", 3)]
    assert all(r["identical"] and r["ms_per_step_on"] > 0 and r["host_ms_per_step_off"] > 0 for r in rows)
    # each decode run's prefill step joins its parts either way; the general path joins every decode step too
    assert all(r["joined_readbacks_on"] == r["rounds"] and r["joined_readbacks_off"] > 3 * r["rounds"] for r in rows)
    assert result["greedy_graphs"] == 2 * 2  # decode rungs 1 and 4 (3 sequences), for each setting
