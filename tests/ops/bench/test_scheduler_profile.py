"""`ops/bench/scheduler_profile.py`: py-spy's raw stacks summarized (threads, own and inclusive
shares, the GIL's held share), and a real recording of a live Python process with two threads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from ops.bench import scheduler_profile
from ops.bench.scheduler_profile import Recording, summarize

RAW = """\
thread (101): scheduler-step;Thread.run (threading.py:982);SchedulerCore.step (services/scheduler/core.py:120);Policy.update (services/scheduler/policy.py:473) 30
thread (101): scheduler-step;Thread.run (threading.py:982);SchedulerCore.step (services/scheduler/core.py:121);Policy.update (services/scheduler/policy.py:480) 10
thread (101): scheduler-step;Thread.run (threading.py:982);SchedulerCore.step (services/scheduler/core.py:130) 20
thread (7): MainThread;run (asyncio/runners.py:118);_token_batch (services/scheduler/wire.py:50) 40

not a line
"""


def test_stacks_are_summed_by_thread_own_and_inclusive_function_without_line_numbers():
    summary = summarize(RAW, rate_hz=100, seconds=2.0)
    assert summary["samples"] == 100
    assert summary["gil_held_share"] == 0.5  # 100 samples of 200 possible
    assert summary["threads"] == {"MainThread": 0.4, "scheduler-step": 0.6}
    assert summary["own"] == {"Policy.update (services/scheduler/policy.py)": 0.4, "_token_batch (services/scheduler/wire.py)": 0.4,
                              "SchedulerCore.step (services/scheduler/core.py)": 0.2}  # fmt: skip
    inclusive = summary["inclusive"]
    assert inclusive["SchedulerCore.step (services/scheduler/core.py)"] == 0.6  # two lines of one function: counted once a stack
    assert inclusive["Thread.run (threading.py)"] == 0.6 and inclusive["run (asyncio/runners.py)"] == 0.4
    table = scheduler_profile.table(summary)
    assert "held 50% of 2.0 s" in table and "| 40.0% | Policy.update (services/scheduler/policy.py) |" in table


def test_nothing_sampled_is_an_empty_summary_not_a_division_by_zero():
    summary = summarize("", rate_hz=250, seconds=3.0)
    assert summary["samples"] == 0 and summary["gil_held_share"] == 0.0 and summary["own"] == {} and summary["threads"] == {}


SPINNER = textwrap.dedent("""
    import threading, time
    def spin_in_the_step_thread():
        end = time.monotonic() + 20
        while time.monotonic() < end:
            sum(range(1000))
    thread = threading.Thread(target=spin_in_the_step_thread, name="step-thread")
    thread.start()
    print("ready", flush=True)
    thread.join()
""")


@pytest.mark.timeout(60)
def test_a_recording_of_a_live_process_finds_its_busy_thread_and_function(tmp_path):
    pytest.importorskip("ops.bench.scheduler_profile")
    try:
        scheduler_profile.py_spy()
    except RuntimeError:
        pytest.skip("py-spy is not installed (the test extras install it)")
    child = subprocess.Popen([sys.executable, "-c", SPINNER], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        recording = Recording.start(child.pid, tmp_path / "spy.txt", rate_hz=200)
        time.sleep(1.5)
        summary = recording.stop(1.5)
    finally:
        child.kill()
        child.wait()
    if "error" in summary and ("ermission" in summary["error"] or "not permitted" in summary["error"]):
        pytest.skip(f"this machine does not let py-spy read another process: {summary['error']}")
    assert "error" not in summary, summary
    assert summary["samples"] > 50
    assert max(summary["threads"], key=summary["threads"].get) == "step-thread"
    assert summary["inclusive"]["spin_in_the_step_thread (<string>)"] > 0.8
    assert 0.5 < summary["gil_held_share"] <= 1.2
