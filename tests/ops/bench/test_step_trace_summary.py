"""`sparkwire bench step-trace` (ops/bench/step_trace_summary.py) on hand-written trace lines: each step's kind, the sums and the
time-weighted decode batch."""

from __future__ import annotations

import gzip
import json

import pytest

from ops.bench.step_trace_summary import kind_of, read_trace, summarize, table
from tests.ops.bench.bench_cli import bench


def _line(t, dur, seqs=None, tokens=0, prefill=0, followed=False, turn=0.0, held=False):
    line = {"t": t, "dur_s": dur, "turn_s": turn, "held": held, "running": 0, "waiting": 0}
    if seqs is not None:
        line |= {"num_seqs": seqs, "num_tokens": tokens, "num_prefill_tokens": prefill, "num_sampling": seqs,
                 "followed": followed, "follows": followed, "collect_s": dur / 2}  # fmt: skip
    return line


LINES = [
    _line(10.0, 0.050, seqs=16, tokens=2048, prefill=2048),  # prefill alone
    _line(10.05, 0.040, seqs=30, tokens=2062, prefill=2048, turn=0.001),  # chunks beside 14 decodes
    _line(10.09, 0.006, seqs=64, tokens=64),  # decode, planned after the readback
    _line(10.096, 0.006, seqs=64, tokens=64, followed=True, turn=0.002, held=True),
    _line(10.102, 0.002, seqs=32, tokens=32, followed=True),
    _line(10.104, 0.001),  # planned nothing
]


def test_kinds_and_sums():
    assert [kind_of(line) for line in LINES] == ["prefill", "mixed", "decode", "decode_followed", "decode_followed", "idle"]
    summary = summarize(LINES)
    assert summary["num_steps"] == 6 and summary["span_s"] == pytest.approx(0.105)
    assert summary["busy_s"] == pytest.approx(0.105) and summary["held_s"] == pytest.approx(0.002)
    assert summary["waited_for_work_s"] == pytest.approx(0.001)
    assert summary["decode_batch_time_weighted"] == pytest.approx((64 * 0.006 * 2 + 32 * 0.002) / 0.014)
    followed = summary["kinds"]["decode_followed"]
    assert (followed["steps"], followed["seqs"], followed["ms_per_step"]) == (2, 48, pytest.approx(4.0))
    assert (followed["collect_ms"], followed["host_ms"]) == (pytest.approx(2.0), pytest.approx(2.0))  # each waited half its step
    assert followed["wait_ms"] == followed["collect_ms"]  # lines without wait_s (older traces): the collect time stands in
    assert followed["host_late_share"] == 0  # every step waited for its readback
    late = [_line(1.0, 0.002, seqs=8, tokens=8, followed=True) | {"wait_s": 0.0}, _line(1.002, 0.002, seqs=8, tokens=8, followed=True)]
    decodes = summarize(late)["kinds"]["decode_followed"]
    assert decodes["host_late_share"] == 0.5  # one of two found its readback back (its collecting still took 1 ms)
    assert decodes["wait_ms"] == pytest.approx(0.5) and decodes["host_ms"] == pytest.approx(1.5)
    assert (decodes["late_ms_per_step"], decodes["waited_ms_per_step"]) == (pytest.approx(2.0), pytest.approx(2.0))
    assert (decodes["host_ms_p50"], decodes["host_ms_p90"]) == (pytest.approx(1.5), pytest.approx(1.9))  # hosts 2 and 1 ms
    assert summary["kinds"]["mixed"]["prefill_tokens"] == 2048 and summary["kinds"]["idle"]["steps"] == 1
    assert "| mixed | 1 |" in table(summary)
    assert all(line.count("|") == 12 for line in table(summary).splitlines()[1:])  # eleven columns, idle's blank


def test_the_time_between_steps_is_the_span_less_the_steps_and_the_turns_after_the_first():
    # three decode steps of 2 ms: a turn of 0.3 ms before the first (outside the span), 0.5 ms
    # held before the second, then 0.1 ms of the thread's own between its end and the turn; 0.2 ms
    # between the second and the third with no turn
    lines = [_line(1.0, 0.002, seqs=8, tokens=8, turn=0.0003), _line(1.0026, 0.002, seqs=8, tokens=8, turn=0.0005, held=True),
             _line(1.0048, 0.002, seqs=8, tokens=8)]  # fmt: skip
    summary = summarize(lines)
    assert summary["span_s"] == pytest.approx(0.0068) and summary["busy_s"] == pytest.approx(0.006)
    assert summary["between_steps_s"] == pytest.approx(0.0003)
    assert "between steps 0.000 s" in table(summary)


def test_a_window_keeps_the_steps_that_began_inside_it(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    assert [line["t"] for line in read_trace(path, (10.05, 10.1))] == [10.05, 10.09, 10.096]
    packed = tmp_path / "s.jsonl.gz"  # a trace kept gzipped in the results
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert read_trace(packed) == read_trace(path)
    assert summarize([]) == {"num_steps": 0} and table(summarize([])) == "no steps in the window"


def test_the_command_prints_a_trace_files_window_as_json(tmp_path, capsys):
    path = tmp_path / "scheduler.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    assert bench("step-trace", path, "--window", 10.05, 10.1, "--json") == 0
    assert json.loads(capsys.readouterr().out) == summarize(read_trace(path, (10.05, 10.1)))


def test_queue_times_and_the_running_count_weighted_by_time():
    lines = [_line(1.0, 0.004, seqs=2, tokens=256, prefill=256) | {"running": 2, "queued_s": [0.001, 0.003]},
             _line(1.004, 0.002, seqs=2, tokens=2) | {"running": 2},
             _line(1.006, 0.002, seqs=3, tokens=130, prefill=128) | {"running": 3, "queued_s": [0.008]},
             _line(1.008, 0.002, seqs=3, tokens=3) | {"running": 1}]  # fmt: skip
    summary = summarize(lines)
    assert summary["admitted"] == 3
    assert summary["queue_ms"] == {"mean": pytest.approx(4.0), "p50": pytest.approx(3.0), "p90": pytest.approx(7.0), "max": pytest.approx(8.0)}
    assert summary["running_time_weighted"] == pytest.approx((2 * 0.004 + 2 * 0.002 + 3 * 0.002 + 1 * 0.002) / 0.010)
    assert "3 admitted, queued 4.00 ms mean, 7.00 p90" in table(summary)
    assert summarize(lines[1:2])["queue_ms"] is None and "admitted" not in table(summarize(lines[1:2]))
