"""`sparkwire up` supervises: a service or the embedded nats-server killed with SIGKILL comes
back (logged, after a backoff) as a new instance, and the stack serves again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from e2e.stack import generate_body
from e2e.test_up import start_up, wait_for_line
from ops.bench.reliability import descendants
from services.common.nats_server import free_port


def pid_of(root: int, needle: str) -> int:
    """The live process below `root` whose command line contains `needle`."""
    for pid in descendants(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle.encode() in b" ".join(argv):
            return pid
    raise LookupError(needle)


def wait_status(url: str, want: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == want:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"/health never {want} within {timeout_s}s")


def instances(url: str, kind: str) -> list[str]:
    """The live instances of a service kind, as /health?verbose lists them."""
    try:
        return httpx.get(f"{url}/health?verbose", timeout=2).json()["services"][kind]["instances"]
    except (httpx.HTTPError, KeyError, ValueError):
        return []


def wait_until_true(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not true within {timeout_s}s"
        time.sleep(0.2)


def generates(url: str) -> bool:
    response = httpx.post(f"{url}/generate", json=generate_body(max_new_tokens=4), timeout=30)
    return response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] == 4


@pytest.mark.timeout(240)
def test_up_restarts_a_killed_service_and_its_nats_server(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process, log = start_up(tmp_path, port)
    try:
        wait_for_line(process, log, f"Sparkwire ready on {url}", 120)
        for name in ("detokenizer", "scheduler"):
            before = instances(url, name)
            os.kill(pid_of(process.pid, f"services.cli {name}"), signal.SIGKILL)
            wait_for_line(process, log, f"{name} restarted", 30)
            wait_until_true(lambda: instances(url, name) not in ([], before), 90)  # a new instance serves
            wait_status(url, 200, 90)
            assert generates(url)
        os.kill(pid_of(process.pid, "nats-server"), signal.SIGKILL)
        wait_for_line(process, log, "nats-server restarted", 30)
        wait_status(url, 200, 60)
        assert generates(url)
        assert process.poll() is None
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, log.read_text()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
