"""`sparkwire bench serve --launch`: run the benchmark against a `sparkwire up` of its own; and the
child-process handling every bench script that starts services shares (`LoggedProcess`).

The stack is started with the given `up` flags on the host and port of the benchmark's base URL,
waited for until `/health` answers 200, and stopped (SIGTERM, which `up` passes on to every
service) when the block ends, also on error. Its output goes to a log file, never a pipe that
could fill up and stall the services mid-run. Scripts that start the services one by one (to pin
each to a GPU, or stop one mid-run: `two_gpu_serve.py`) use `LoggedProcess` and `health_ok` alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from services.common.nats_server import stop_process

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.25
STOP_GRACE_S = 60.0  # `up` itself gives each service 10 s after SIGTERM, and they drain first
LOG_TAIL_CHARS = 4000
OWNED_FLAGS = ("--host", "--port")  # taken from the base URL, so the benchmark hits what it started
SCHEDULER_METRICS = re.compile(r"Prometheus metrics: scheduler (\S+/metrics)")  # `up`'s line naming the scheduler's page
PREFIX_HITS, PREFIX_QUERIES = "sparkwire:prefix_cache_hits_total", "sparkwire:prefix_cache_queries_total"


@dataclass
class LoggedProcess:
    """A child process run from the repository root, its output (stdout and stderr) in `log_path`
    from byte `log_start` on (what the file held before, with `append`, is an earlier process's)."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_start: int = 0

    @classmethod
    def start(
        cls, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None, append: bool = False
    ) -> LoggedProcess:
        """`env`: variables added to ours; `append`: keep what the log file holds (a restart)."""
        with log_path.open("ab" if append else "wb") as log:
            env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
            process = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
            return cls(name, process, log_path, log.tell())

    def log(self) -> str:
        """What this process has written so far."""
        with self.log_path.open("rb") as log:
            log.seek(self.log_start)
            return log.read().decode(errors="replace")

    def log_tail(self) -> str:
        return self.log()[-LOG_TAIL_CHARS:]

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, waiting_for: str) -> float:
        """Seconds until `ready()`; raises with the log's tail if the process exits or time runs out."""
        start = time.monotonic()
        while not ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"{waiting_for} after {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(POLL_S)
        return time.monotonic() - start

    def stop(self, grace_s: float) -> None:
        stop_process(self.process, grace_s)


@dataclass
class LaunchedStack:
    up: LoggedProcess  # `sparkwire up`
    ready_s: float = 0.0
    exit_code: int | None = None


def health_ok(base_url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200
    return False


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
    stack = LaunchedStack(LoggedProcess.start("sparkwire up", command, log_path))
    try:
        stack.ready_s = stack.up.wait_until(lambda: health_ok(base_url), ready_timeout_s, f"{base_url}/health not 200")
        yield stack
    finally:
        stack.up.stop(STOP_GRACE_S)
        stack.exit_code = stack.up.process.returncode


def scheduler_metrics_url(stack: LaunchedStack, timeout_s: float = 30.0) -> str:
    """The scheduler's Prometheus page, as `up` logs it."""
    stack.up.wait_until(lambda: SCHEDULER_METRICS.search(stack.up.log()) is not None, timeout_s, "no metrics line from `up`")
    return SCHEDULER_METRICS.search(stack.up.log()).group(1)


def prefix_cache_counters(metrics_url: str) -> dict[str, float]:
    """The scheduler's prefix-cache counters, in prompt tokens: hits (KV found computed) and queries (all)."""
    text = httpx.get(metrics_url, timeout=10).text
    found = {name: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() for name in (PREFIX_HITS, PREFIX_QUERIES)
             if line.startswith(name + "{")}  # fmt: skip
    return {"hits": found[PREFIX_HITS], "queries": found[PREFIX_QUERIES]}
