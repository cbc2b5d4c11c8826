"""`sparkwire bench serve --launch`: run the benchmark against a `sparkwire up` of its own.

The stack is started with the given `up` flags on the host and port of the benchmark's base URL,
waited for until `/health` answers 200, and stopped (SIGTERM, which `up` passes on to every
service) when the block ends, also on error. Its output goes to a log file, never a pipe that
could fill up and stall the services mid-run.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from services.common.nats_server import stop_process

REPO = Path(__file__).resolve().parents[2]
HEALTH_POLL_S = 0.25
STOP_GRACE_S = 60.0  # `up` itself gives each service 10 s after SIGTERM, and they drain first
LOG_TAIL_CHARS = 4000
OWNED_FLAGS = ("--host", "--port")  # taken from the base URL, so the benchmark hits what it started


@dataclass
class LaunchedStack:
    process: subprocess.Popen[bytes]
    log_path: Path
    ready_s: float = 0.0
    exit_code: int | None = None

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]


def up_command(up_args: Sequence[str], base_url: str) -> list[str]:
    if owned := [flag for flag in up_args if flag.split("=")[0] in OWNED_FLAGS]:
        raise ValueError(f"{owned}: host and port come from --base-url")
    url = urlsplit(base_url)
    if url.scheme != "http" or url.port is None:
        raise ValueError(f"--launch needs an http:// base URL with a port, got {base_url!r}")
    host = url.hostname or "127.0.0.1"
    return [sys.executable, "-m", "services.cli", "up", "--host", host, "--port", str(url.port), *up_args]


@contextlib.contextmanager
def launched_stack(
    up_args: Sequence[str], base_url: str, log_path: Path, ready_timeout_s: float = 600.0
) -> Iterator[LaunchedStack]:
    command = up_command(up_args, base_url)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
    stack = LaunchedStack(process, log_path)
    try:
        stack.ready_s = wait_healthy(stack, base_url, ready_timeout_s)
        yield stack
    finally:
        stop_process(process, STOP_GRACE_S)
        stack.exit_code = process.returncode


def wait_healthy(stack: LaunchedStack, base_url: str, timeout_s: float) -> float:
    """Seconds until `GET /health` is 200; raises with the log's tail if `up` exits or time runs out."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if stack.process.poll() is not None:
            raise RuntimeError(f"sparkwire up exited with {stack.process.returncode}:\n{stack.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return time.monotonic() - start
        time.sleep(HEALTH_POLL_S)
    raise TimeoutError(f"{base_url}/health not 200 after {timeout_s:.0f}s:\n{stack.log_tail()}")
