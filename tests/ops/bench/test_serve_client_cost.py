"""`ops/bench/serve_client_cost.py` at toy size: every client streams every event of every request."""

from __future__ import annotations

import argparse

from ops.bench.serve_client_cost import CLIENTS, run


def test_every_client_reads_every_event_with_and_without_top_logprobs(tmp_path):
    args = argparse.Namespace(num_prompts=5, concurrency=2, input_len=4, output_len=3, interval_ms=1.0, repeats=1, logprobs=[2],
                              out=tmp_path / "cost.json")  # fmt: skip
    result = run(args)
    assert [(r["client"], r["logprobs"]) for r in result["rows"]] == [(c, k) for k in (None, 2) for c in CLIENTS]
    assert all(r["events"] == 5 * 3 and r["cpu_us_per_event"] > 0 for r in result["rows"])
    assert (tmp_path / "cost.json").is_file()
