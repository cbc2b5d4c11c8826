"""ops/bench/step_gap.py's figures from timed steps, and its table."""

from __future__ import annotations

import pytest

from ops.bench.step_gap import gap_figures, summary


def _steps(*spans: tuple[float, float, bool]) -> list[dict]:
    return [{"start": start, "end": end, "work_left": left} for start, end, left in spans]


def test_gaps_count_only_after_steps_that_left_work():
    steps = _steps((0.0, 1.0, True), (1.002, 2.0, True), (2.004, 3.0, False), (9.0, 10.0, True), (10.001, 11.0, False))
    figures = gap_figures(steps)  # the 6 s after the third step were idleness, not overhead
    assert (figures["num_steps"], figures["num_gaps"]) == (5, 3)
    assert figures["gap_ms_mean"] == pytest.approx((2 + 4 + 1) / 3)
    assert figures["step_ms_mean"] == pytest.approx((998 + 996 + 1000 + 999 + 1000) / 5)
    assert figures["busy"] == pytest.approx(sum([998, 996, 1000, 999, 1000]) / (sum([998, 996, 1000, 999, 1000]) + 7), rel=1e-6)


def test_the_table_has_a_row_per_run_and_survives_runs_too_short_for_gaps():
    serve = {"completed": 4, "failed": 0, "output_throughput": 123.4, "tpot_ms": {"mean": 5.5}}
    runs = [{"loop": "baseline", "concurrency": 16, **gap_figures(_steps((0.0, 1.0, False))), "serve": serve},
            {"loop": "current", "concurrency": 16, **gap_figures(_steps(*[(k, k + 0.9, True) for k in range(5)])), "serve": serve}]  # 4 gaps of 0.1 s
    table = summary({"runs": runs})
    assert "| baseline | 16 | 1 | nan/nan/nan/nan |" in table
    assert "| current | 16 | 5 | 100.000/100.000/100.000/100.000 | 900.00 | 0.918 | 4 / 0 | 123 | 5.50 |" in table
