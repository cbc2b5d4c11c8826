"""`ops/bench/metrics_cost.py` at toy size: both histograms time and expose the same figures."""

from __future__ import annotations

import argparse

from ops.bench.metrics_cost import run


def test_both_histograms_are_timed_and_expose_the_same(tmp_path):
    result = run(argparse.Namespace(tokens=40, repeats=20, out=tmp_path / "cost.json"))
    assert result["same_exposition"] and result["histogram_us"] > 0 and result["bulk_histogram_us"] > 0
    assert (tmp_path / "cost.json").is_file()
