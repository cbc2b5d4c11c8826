"""The scheduler CLI starts in this order: connect to NATS, load the model, then subscribe and beat
(services/scheduler/__main__.py). A wrong password fails before the load begins, a bad model
directory before the connection; while it loads the scheduler is in no queue group and sends no
heartbeat; a SIGTERM during the load, or while waiting for NATS, exits 0.

Each test runs the real CLI in a subprocess whose load (`build_core`) is held: it does native
torch work, as a load of minutes does, until the test creates a release file. A test that waited
on a held load that should never have begun fails by pytest's timeout."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from nats.errors import NoRespondersError

from contracts import subjects
from contracts.control import Heartbeat
from contracts.scheduler import SchedulerClaim, SchedulerClaimReply, SchedulerInfo, SchedulerPing
from services.common.nats_auth import draw_passwords, server_environ
from services.common.nats_server import SECURED_CONFIG, free_port, start_nats_server
from services.common.transport import Transport
from tests.nats_queues import queued

REPO = Path(__file__).resolve().parents[3]
SECRET = "s3cret-never-shown"
NEVER_S = "3600"  # a NATS start timeout no test waits for

HELD_LOAD = """
import sys, pathlib, torch
import services.scheduler.__main__ as entry
from services.cli import main

release, real_build_core = pathlib.Path(sys.argv[1]), entry.build_core

def held_build_core(config):
    x = torch.randn(256, 256)  # native work in the load's thread, as a real load does
    while not release.exists():
        x = torch.tanh(x @ x)
    return real_build_core(config)

entry.build_core = held_build_core
sys.exit(main(["scheduler", *sys.argv[2:]]))
"""


class HeldScheduler:
    """`sparkwire scheduler` with a held load; its output lines (stdout and stderr) are collected."""

    def __init__(self, release: Path, args: list[str], env: dict[str, str]) -> None:
        command = [sys.executable, "-c", HELD_LOAD, str(release), "--device", "cpu", *args]
        self.process = subprocess.Popen(command, cwd=REPO, env={**os.environ, **env}, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        self.lines: list[str] = []
        self._new: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            self._new.put(line)

    def wait_for(self, text: str) -> None:
        while text not in self._new.get(timeout=60):
            pass

    def wait(self) -> int:
        code = self.process.wait(timeout=60)
        self.process.stdout.close()
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def held(tmp_path):
    started: list[HeldScheduler] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> HeldScheduler:
        started.append(HeldScheduler(tmp_path / "release", args, env or {}))
        return started[-1]

    yield start
    for scheduler in started:
        scheduler.kill()


@pytest.mark.timeout(90)
def test_a_wrong_password_fails_before_the_load_begins(held):
    passwords = draw_passwords()
    server = start_nats_server(SECURED_CONFIG, env=server_environ(passwords))
    try:
        scheduler = held(["--nats-url", server.url, "--nats-user", "scheduler"],
                         {"SPARKWIRE_NATS_PASSWORD": SECRET, "SPARKWIRE_NATS_START_TIMEOUT_S": NEVER_S})  # fmt: skip
        code = scheduler.wait()  # the load is held: only a start that never began it ends
    finally:
        server.stop()
    assert code == 1
    assert "scheduler.load" not in scheduler.output
    last = scheduler.lines[-1]
    assert last.startswith("sparkwire: scheduler-") and "rejected our credentials (user 'scheduler'" in last
    assert SECRET not in scheduler.output and passwords["scheduler"] not in scheduler.output


@pytest.mark.timeout(90)
def test_a_bad_model_directory_fails_at_once_without_waiting_for_nats(held, tmp_path):
    absent = f"nats://127.0.0.1:{free_port()}"  # nothing listens: a start that connected first would wait an hour
    scheduler = held(["--model", str(tmp_path / "no-such-model"), "--nats-url", absent],
                     {"SPARKWIRE_NATS_START_TIMEOUT_S": NEVER_S})  # fmt: skip
    assert scheduler.wait() == 2
    assert "cannot load" in scheduler.lines[-1] and "no-such-model" in scheduler.lines[-1]
    assert "Traceback" not in scheduler.output


@pytest.mark.timeout(120)
def test_while_loading_it_takes_no_claim_and_sends_no_heartbeat_then_it_serves(held, nats_server, tmp_path):
    scheduler = held(["--nats-url", nats_server.url, "--instance-id", "sched-start"])
    scheduler.wait_for("scheduler.load.started")

    async def scenario() -> SchedulerInfo:
        client = await Transport.connect(nats_server.url, "test-client")
        beats = await queued(client, subjects.heartbeat("scheduler"), Heartbeat)
        await client.flush()
        with pytest.raises(NoRespondersError):  # loading: not in the claim queue group
            await client.request(subjects.SCHEDULER_CLAIM, SchedulerClaim("r1", 4), SchedulerClaimReply, timeout=5)
        assert beats.empty()
        (tmp_path / "release").touch()
        beat = await asyncio.wait_for(beats.get(), 60)  # the first beat still means "ready"
        assert beat.alive and beat.instance_id == "sched-start"
        info = await client.request(subjects.SCHEDULER_PING, SchedulerPing(0.0), SchedulerInfo, timeout=5)
        await client.close()
        return info

    info = asyncio.run(scenario())
    assert info.scheduler_id == "sched-start"
    scheduler.process.send_signal(signal.SIGTERM)
    assert scheduler.wait() == 0
    assert "scheduler.ready" in scheduler.output and "Traceback" not in scheduler.output


@pytest.mark.timeout(90)
def test_a_sigterm_during_the_load_exits_0_at_once(held, nats_server):
    scheduler = held(["--nats-url", nats_server.url])
    scheduler.wait_for("scheduler.load.started")
    scheduler.process.send_signal(signal.SIGTERM)
    code = scheduler.wait()  # the load is held: a stop that waited it out would never end
    assert code == 0, scheduler.output
    assert "scheduler.load.abandoned" in scheduler.output and "scheduler.stopped" in scheduler.output
    assert "Traceback" not in scheduler.output and "terminate called" not in scheduler.output


@pytest.mark.timeout(90)
def test_a_sigterm_while_waiting_for_nats_exits_0_without_loading(held):
    absent = f"nats://127.0.0.1:{free_port()}"
    scheduler = held(["--nats-url", absent], {"SPARKWIRE_NATS_START_TIMEOUT_S": NEVER_S})
    scheduler.wait_for("nats.start_retrying")
    scheduler.process.send_signal(signal.SIGTERM)
    assert scheduler.wait() == 0, scheduler.output
    assert "scheduler.load" not in scheduler.output and "Traceback" not in scheduler.output
