"""`LoggedProcess`, the child-process handling the bench scripts share, on plain Python children."""

from __future__ import annotations

import signal
import sys

import pytest

from ops.bench.serve_launch import REPO, LoggedProcess, health_ok
from services.common.nats_server import free_port

# Prints where it runs and a variable from its environment, then waits to be stopped.
WAITER = "import os, time; print('ready', os.getcwd(), os.environ['MARK'], flush=True); time.sleep(60)"


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.timeout(60)
def test_a_child_runs_from_the_repository_logs_to_its_file_and_stops(tmp_path):
    log_path = tmp_path / "child.log"
    log_path.write_text("ready, said an earlier run\n")
    child = LoggedProcess.start("child", python(WAITER), log_path, env={"MARK": "m1"}, append=True)
    try:
        assert child.wait_until(lambda: "ready" in child.log(), 30, "child not ready") >= 0
        assert child.log() == f"ready {REPO} m1\n"  # its own output: the earlier run's "ready" is not
        assert log_path.read_text() == f"ready, said an earlier run\nready {REPO} m1\n"
    finally:
        child.stop(grace_s=10)
    assert child.process.returncode == -signal.SIGTERM
    fresh = LoggedProcess.start("child", python("print('only me')"), log_path)
    fresh.process.wait()
    assert fresh.log() == "only me\n"  # without append the file starts empty


@pytest.mark.timeout(60)
def test_waiting_names_the_child_that_exited_and_shows_its_log(tmp_path):
    child = LoggedProcess.start("broken", python("import sys; print('bad config'); sys.exit(3)"), tmp_path / "b.log")
    with pytest.raises(RuntimeError, match="broken exited with 3:\nbad config"):
        child.wait_until(lambda: False, 30, "broken not ready")


@pytest.mark.timeout(60)
def test_waiting_gives_up_with_the_log_tail(tmp_path):
    child = LoggedProcess.start("slow", python(WAITER), tmp_path / "s.log", env={"MARK": "m2"})
    try:
        child.wait_until(lambda: "ready" in child.log(), 30, "slow not ready")
        with pytest.raises(TimeoutError, match="slow never done after 0s:\nready .* m2"):
            child.wait_until(lambda: False, 0.2, "slow never done")
    finally:
        child.stop(grace_s=10)


def test_health_is_false_where_nothing_listens():
    assert not health_ok(f"http://127.0.0.1:{free_port()}")
