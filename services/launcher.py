"""`sparkwire up`: the whole stack on one machine.

Starts an embedded nats-server (unless `--nats-url` is given), then the scheduler, detokenizer and
tokenizer as separate processes (`--tokenizers N`: N tokenizers on the one port, SO_REUSEPORT, the
kernel spreading the connections; each publishes its counts into one temporary directory, so
/metrics on that port answers the sum of all of them whichever takes the connection:
services/common/metrics_shared.py), waits until `GET /health` answers 200 and prints the URL. With
`--record FILE`, a `sparkwire record` child subscribes first and writes every message of the stack
to FILE (it is not restarted: a recording with a gap would replay as if nothing were missing).
Ctrl-C or SIGTERM stops everything: SIGTERM to each service, SIGKILL after a grace period, then
the recorder (so it keeps the services' last messages), then the nats-server. Once ready, `up` supervises: a service that dies is reported (name, exit code,
last output lines) and restarted after a backoff (0.5 s, doubling to 30 s; back to 0.5 s once it
stayed up for a minute), and so is the embedded nats-server, on the same port so the services
reconnect. A service that dies before the stack was ever ready (a bad flag, a missing model), or
dies again and again without staying up, stops `up` with a non-zero exit. Service logs are echoed to
stderr, prefixed with the service name; stdout carries only the ready line.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgspec

from services.common.connection import NatsConnection, connection_from_args
from services.common.model_source import ModelSourceError, refuse_remote_code, resolve_model, source_argv
from services.common.nats_auth import draw_passwords, server_environ
from services.common.nats_server import SECURED_CONFIG, NatsServer, free_port, start_nats_server
from services.common.settings import PREFIX, connection_environ, connection_values
from services.models import BUNDLED_DRAFT_MODEL
from services.scheduler.flags import scheduler_argv
from services.supervision import Backoff, Child, write_line

START_ORDER = ("scheduler", "detokenizer", "tokenizer")
SHARED_METRICS = ("tokenizer",)  # the kinds `up` may run as several processes, one /metrics page for all
POLL_S = 0.2
HEALTH_POLL_S = 0.5
PROGRESS_EVERY_S = 5.0
RECORDER_READY_TIMEOUT_S = 30.0


class RecorderError(Exception):
    """`--record`'s recorder exited, or did not subscribe in time (the message is its report)."""


def service_argv(
    name: str, args: argparse.Namespace, metrics_port: int | None = None, metrics_dir: Path | None = None
) -> list[str]:
    """The command line of one service, as `sparkwire <name>` would be run by hand; the NATS
    connection travels in its environment (`service_environ`), where no secret shows in `ps`.
    `metrics_dir`: where the processes of this kind publish their counts for one /metrics page."""
    argv = [sys.executable, "-m", "services.cli", name]
    argv += ["--model", args.model, "--log-level", args.log_level, *source_argv(args, name)]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    if metrics_dir is not None:
        argv += ["--metrics-dir", str(metrics_dir)]
    if name == "scheduler":
        argv += scheduler_argv(args)
    if name == "tokenizer":
        argv += ["--host", args.host, "--port", str(args.port), "--max-logprobs", str(args.max_logprobs)]
        argv += ["--reuse-port"] if num_tokenizers(args) > 1 else []  # they share the port
        argv += ["--served-model-name", args.served_model_name] if args.served_model_name else []
        argv += ["--chat-template", str(args.chat_template)] if args.chat_template else []
    if name in ("scheduler", "tokenizer") and args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    return argv


def service_environ(connection: NatsConnection) -> dict[str, str]:
    """Ours, minus any inherited connection variable, plus the child's own connection."""
    inherited = {PREFIX + name.upper() for name in NatsConnection.__struct_fields__}
    env = {key: value for key, value in os.environ.items() if key not in inherited}
    return env | connection_environ(connection) | {"PYTHONUNBUFFERED": "1"}


def reachable_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host  # a wildcard bind is not an address


def health_url(host: str, port: int) -> str:
    return f"http://{reachable_host(host)}:{port}/health"


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((reachable_host(host), port)) == 0


def is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def say(message: str) -> None:
    write_line(f"sparkwire up: {message}")


class Stack:
    """The processes `up` owns, stopped in reverse start order."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.nats: NatsServer | None = None
        self.nats_started_at = 0.0
        self.connection: NatsConnection = connection_from_args(args, connection_values())
        self.passwords: dict[str, str] = {}  # of the embedded server's users
        self.children: list[Child] = []
        self.recorder: Child | None = None  # `--record`: started first, stopped after the services
        self.recorder_reported = False
        self.backoffs: dict[str, Backoff] = collections.defaultdict(Backoff)
        self.stop_requested = threading.Event()
        self.metrics_urls: dict[str, str] = {}
        # the tokenizer's metrics are on its HTTP port
        self.metrics_ports = {name: free_port() for name in START_ORDER if name != "tokenizer"}
        self.metrics_root: Path | None = None  # a directory per service kind that runs as several processes

    def start(self) -> None:
        if not self.connection.nats_url:
            self._start_nats()
        draft = f", draft {self.args.draft_model or BUNDLED_DRAFT_MODEL}" if self.args.speculative_algorithm == "dspark" else ""
        say(f"serving {self.args.model}{draft}")
        if self.args.record is not None:
            self.recorder = self._start_recorder(self.args.record)
        self.metrics_root = Path(tempfile.mkdtemp(prefix="sparkwire-metrics-"))
        for name in START_ORDER:
            copies = num_tokenizers(self.args) if name == "tokenizer" else 1
            self.children += [self._start_child(name if k == 1 else f"{name}-{k}") for k in range(1, copies + 1)]
        self.metrics_urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in self.metrics_ports.items()}
        self.metrics_urls["tokenizer"] = f"http://{reachable_host(self.args.host)}:{self.args.port}/metrics"

    def _start_child(self, name: str) -> Child:
        """The same command line and environment on every (re)start: same identity and metrics port.
        `name`: the service, or `tokenizer-2`, ... for the copies of `--tokenizers N`."""
        kind = name.split("-")[0]
        env = service_environ(self._identity(kind))
        if self.args.api_key:
            env["SPARKWIRE_API_KEY"] = self.args.api_key  # not in argv: `ps` shows argv
        env["SPARKWIRE_LOG_FORMAT"] = self.args.log_format
        metrics_dir = self.metrics_root / kind if kind in SHARED_METRICS and self.metrics_root is not None else None
        return Child.start(name, service_argv(kind, self.args, self.metrics_ports.get(kind), metrics_dir), env)

    def _start_recorder(self, path: Path) -> Child:
        """`sparkwire record` under its own identity (it may read every subject, publish none); the
        services start only once it is subscribed, so the recording holds their first messages."""
        from services.recorder.__main__ import READY_PREFIX

        argv = [sys.executable, "-m", "services.cli", "record", "--out", str(path), "--log-level", self.args.log_level]
        recorder = Child.start("recorder", argv, service_environ(self._identity("recorder")), ready_prefix=READY_PREFIX)
        deadline = time.monotonic() + RECORDER_READY_TIMEOUT_S
        while not recorder.ready.wait(POLL_S):
            if recorder.exit_code() is not None or time.monotonic() > deadline:
                raise RecorderError(recorder.report())
        say(f"recording every message to {path}")
        return recorder

    def _identity(self, name: str) -> NatsConnection:
        """A given server: the given credentials. Our own: a user per service kind with a fresh
        password, so none can speak for another (services/common/nats_auth.py)."""
        if self.nats is None:
            return self.connection
        user = {"nats_url": self.nats.url, "nats_user": name, "nats_password": self.passwords[name]}
        return msgspec.structs.replace(self.connection, **user)

    def _start_nats(self, port: int | None = None) -> None:
        """Our own nats-server; on a restart the same port and passwords, so the services reconnect."""
        self.passwords = self.passwords or draw_passwords()
        self.nats = start_nats_server(SECURED_CONFIG, port=port, env=server_environ(self.passwords))
        self.nats_started_at = time.monotonic()
        say(f"nats-server on {self.nats.url}")

    def supervise(self) -> Child | None:
        """Until a stop is asked (None): restart whatever dies, after its backoff. Returns a
        child that died `MAX_RESTARTS_IN_A_ROW` times without staying up: `up` gives up."""
        while not self.stop_requested.wait(POLL_S):
            self._watch_nats()
            self._watch_recorder()
            for index, child in enumerate(self.children):
                if child.exit_code() is None:
                    continue
                backoff = self.backoffs[child.name]
                if backoff.due_at is None:
                    if backoff.exhausted:
                        return child
                    print(child.report(), file=sys.stderr, flush=True)
                    wait = backoff.schedule(time.monotonic() - child.started_at)
                    say(f"restarting {child.name} in {wait:.1f}s (restart {backoff.in_a_row} in a row)")
                elif backoff.is_due():
                    backoff.due_at = None
                    self.children[index] = self._start_child(child.name)
                    say(f"{child.name} restarted (pid {self.children[index].process.pid})")
        return None

    def _watch_nats(self) -> None:
        """The embedded nats-server comes back on the same port: the services reconnect to it."""
        if self.nats is None or self.nats.process.poll() is None:
            return
        backoff = self.backoffs["nats-server"]
        if backoff.due_at is None:
            wait = backoff.schedule(time.monotonic() - self.nats_started_at)
            say(f"nats-server exited with code {self.nats.process.poll()}; restarting it in {wait:.1f}s")
        elif backoff.is_due():
            backoff.due_at = None
            try:
                self._start_nats(port=self.nats.port)
                say(f"nats-server restarted on {self.nats.url}")
            except (OSError, RuntimeError, TimeoutError) as exc:
                say(f"nats-server did not start again: {exc}")

    def _watch_recorder(self) -> None:
        """A recorder that died is said once; serving goes on, unrecorded from then on."""
        if self.recorder is not None and self.recorder.exit_code() is not None and not self.recorder_reported:
            self.recorder_reported = True
            print(self.recorder.report(), file=sys.stderr, flush=True)
            say(f"the recording in {self.args.record} stopped; the stack goes on serving without it")

    def dead_child(self) -> Child | None:
        return next((child for child in self.children if child.exit_code() is not None), None)

    def wait_ready(self) -> Child | None:
        """Until /health is 200 (None), a child dies (that child), a stop is asked or time runs out."""
        url = health_url(self.args.host, self.args.port)
        started = time.monotonic()
        next_progress = started + PROGRESS_EVERY_S
        while not self.stop_requested.is_set():
            if (dead := self.dead_child()) is not None:
                return dead
            if is_healthy(url):
                return None
            now = time.monotonic()
            if now - started > self.args.ready_timeout_s:
                raise TimeoutError(f"{url} not healthy after {self.args.ready_timeout_s:.0f}s")
            if now >= next_progress:
                say(f"waiting for {url} ({now - started:.0f}s)")
                next_progress = now + PROGRESS_EVERY_S
            self.stop_requested.wait(HEALTH_POLL_S)
        return None

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.exit_code() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace_s
        for child in reversed(self.children):
            _wait_or_kill(child, deadline)
        if self.recorder is not None:
            if self.recorder.exit_code() is None:
                self.recorder.process.send_signal(signal.SIGTERM)
            _wait_or_kill(self.recorder, time.monotonic() + self.args.grace_s)
        if self.nats is not None:
            self.nats.stop()
        if self.metrics_root is not None:
            shutil.rmtree(self.metrics_root, ignore_errors=True)


def _wait_or_kill(child: Child, deadline: float) -> None:
    try:
        child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        say(f"{child.name} ignored SIGTERM, killing it")
        child.process.kill()
        child.process.wait()


GPU_TOKENIZERS = (2, 4)  # front ends where a GPU serves, at least and at most: see `gpu_tokenizers`
CORES_PER_TOKENIZER = 4


def gpu_tokenizers(cores: int) -> int:
    """Tokenizers to start beside a GPU scheduler on a host of `cores` CPUs: one per
    CORES_PER_TOKENIZER cores, within GPU_TOKENIZERS. One tokenizer cannot keep up with a GPU's
    top-20 streams, so two is the floor; where the cores allow, four serve a small model's plain
    streams at high concurrency faster than two."""
    low, high = GPU_TOKENIZERS
    return min(high, max(low, cores // CORES_PER_TOKENIZER))


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity: a container's cpuset), or the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def num_tokenizers(
    args: argparse.Namespace, gpu_present: Callable[[], bool] | None = None, cores: Callable[[], int] | None = None
) -> int:
    """--tokenizers, or its default: `gpu_tokenizers` of the CPUs this process may run on where the
    scheduler serves on a GPU (--device cuda, or auto on a machine with NVIDIA's device nodes: read
    without importing torch here), else 1."""
    if args.tokenizers is not None:
        return args.tokenizers
    gpu_present = gpu_present or (lambda: any(Path(p).exists() for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version")))
    on_gpu = args.device == "cuda" or (args.device == "auto" and gpu_present())
    cores = cores or usable_cores
    return gpu_tokenizers(cores()) if on_gpu else 1


def main(args: argparse.Namespace) -> int:
    stack = Stack(args)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _signum, _frame: stack.stop_requested.set())
    try:
        code = _run(stack)
    finally:
        stack.stop()
    say("stopped")
    return code


def _run(stack: Stack) -> int:
    from services.cli import SCHEDULER_PACKAGES, scheduler_install_hint

    missing = [name for name in SCHEDULER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:  # fail before starting anything, in words
        say(f"the scheduler needs {' and '.join(missing)}; {scheduler_install_hint()}")
        return 1
    if num_tokenizers(stack.args) < 1:
        say(f"--tokenizers must be at least 1, got {stack.args.tokenizers}")
        return 2
    try:  # a model id is fetched once, here, before three services look for it (then in the cache)
        refuse_remote_code(stack.args.trust_remote_code)
        resolve_model(stack.args.model, stack.args.revision)
    except ModelSourceError as exc:
        say(str(exc))
        return 2
    if port_in_use(stack.args.host, stack.args.port):
        # Otherwise whatever listens there could answer /health and pass for Sparkwire.
        say(f"port {stack.args.port} is already in use; pick another with --port")
        return 1
    try:
        stack.start()
    except RecorderError as exc:
        say(f"--record: the recorder did not start\n{exc}")
        return 1
    try:
        dead = stack.wait_ready()
    except TimeoutError as exc:
        say(str(exc))
        return 1
    if dead is None and not stack.stop_requested.is_set():
        url = f"http://{stack.args.host}:{stack.args.port}"
        print(f"Sparkwire ready on {url}", flush=True)
        where = ", ".join(f"{name} {metrics}" for name, metrics in stack.metrics_urls.items())
        say(f"Prometheus metrics: {where}")
        dead = stack.supervise()
    if dead is not None:
        print(dead.report(), file=sys.stderr, flush=True)
        return 1
    return 0
