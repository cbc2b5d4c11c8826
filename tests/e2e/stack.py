"""The three services as real processes against a real nats-server, for end-to-end tests.

Each service runs as `python -m services.cli <name> ...` (exactly what `sparkwire <name>` runs);
its output goes to a log file (not a pipe, which could fill up and block the service) that a
failing test prints.
"""

from __future__ import annotations

from collections.abc import Iterator

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.common.nats_server import NatsServer, free_port, start_nats_server, stop_process
from services.models import RANDOM_TINY_MODEL

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120.0
# Replica tests run two schedulers, two tokenizers and two detokenizers on CI's 2 cores: a
# heartbeat can be late by more than the 2 s default there, and a replica wrongly declared dead
# fails its requests. They test graceful leaving (the "dead" sentinel), never silence, so they
# get a timeout no scheduling hiccup reaches; the kill tests keep the default.
REPLICA_HEARTBEAT_TIMEOUT_S = 15.0


def service_argv(name: str, nats_url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", name, "--nats-url", nats_url, *extra]


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def start(cls, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Service:
        """`env`: variables added to ours (e.g. the service's NATS identity)."""
        log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
        with log_path.open("wb") as log:
            env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
            process = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        return cls(name, process, log_path)

    def log_tail(self, num_lines: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()[-num_lines:]
        return f"--- {self.name} (exit code {self.process.poll()}) ---\n" + "\n".join(lines)

    def stop(self, grace_s: float = 10.0) -> None:
        stop_process(self.process, grace_s)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@dataclass
class Stack:
    nats: NatsServer
    log_dir: Path
    port: int = field(default_factory=free_port)
    services: dict[str, Service] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, name: str) -> Service:
        extra = ("--port", str(self.port)) if name == "tokenizer" else ()
        self.services[name] = Service.start(name, service_argv(name, self.nats.url, *extra), self.log_dir)
        return self.services[name]

    def start_all(self) -> None:
        for name in ("scheduler", "detokenizer", "tokenizer"):
            self.start(name)
        self.wait_healthy()

    def wait_healthy(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.raise_if_dead()
            if health_status(self.base_url) == 200:
                return
            time.sleep(0.25)
        raise TimeoutError(f"{self.base_url}/health not 200 after {timeout_s}s\n{self.logs()}")

    def raise_if_dead(self) -> None:
        dead = [service for service in self.services.values() if service.process.poll() is not None]
        if dead:
            raise RuntimeError("service exited:\n" + "\n".join(service.log_tail() for service in dead))

    def logs(self) -> str:
        return "\n".join(service.log_tail() for service in self.services.values())

    def stop(self) -> None:
        for service in reversed(list(self.services.values())):
            service.stop()
        self.nats.stop()


def start_stack(log_dir: Path) -> Stack:
    stack = Stack(start_nats_server(), log_dir)
    try:
        stack.start_all()
    except BaseException:
        stack.stop()
        raise
    return stack


MICRO = ROOT / "ops/models/sparkwire-micro"
MICRO_DRAFT = ROOT / "ops/models/sparkwire-micro-dspark"


def start_micro_stack(log_dir: Path, *scheduler_flags: str) -> Stack:
    """The bundled model's stack, `scheduler_flags` given to its scheduler only."""
    stack = Stack(start_nats_server(), log_dir)
    model = ("--model", str(MICRO))
    for name in ("scheduler", "detokenizer", "tokenizer"):
        extra = (*model, "--port", str(stack.port)) if name == "tokenizer" else model
        extra = (*extra, *scheduler_flags) if name == "scheduler" else extra
        stack.services[name] = Service.start(name, service_argv(name, stack.nats.url, *extra), log_dir)
    try:
        stack.wait_healthy()
    except BaseException:
        stack.stop()
        raise
    return stack


def plain_and_dspark_stacks(tmp_path_factory) -> Iterator[tuple[Stack, Stack]]:
    """A module fixture's body: the bundled model served plain and with its DSpark drafter."""
    plain = start_micro_stack(tmp_path_factory.mktemp("plain"))
    try:
        spec = start_micro_stack(tmp_path_factory.mktemp("dspark"), "--speculative-algorithm", "dspark", "--draft-model", str(MICRO_DRAFT))
    except BaseException:
        plain.stop()
        raise
    yield plain, spec
    spec.stop()
    plain.stop()


def start_replicas(log_dir: Path, count: int = 2, schedulers: int = 1) -> tuple[Stack, list[str]]:
    """`count` detokenizers (`detokenizer-<i>`) and tokenizers (`tokenizer-<i>`, base URLs returned
    in order) on one scheduler (`scheduler`) or more (`scheduler-<i>`), all healthy."""
    stack = Stack(start_nats_server(), log_dir)
    env = {"SPARKWIRE_HEARTBEAT_TIMEOUT_S": str(REPLICA_HEARTBEAT_TIMEOUT_S)}
    urls = []
    try:
        names = ["scheduler"] if schedulers == 1 else [f"scheduler-{index}" for index in range(schedulers)]
        for name in names:
            stack.services[name] = Service.start(name, service_argv("scheduler", stack.nats.url), log_dir, env)
        for index in range(count):
            port = free_port()
            for name, extra in (("detokenizer", ()), ("tokenizer", ("--port", str(port)))):
                argv = service_argv(name, stack.nats.url, *extra)
                stack.services[f"{name}-{index}"] = Service.start(f"{name}-{index}", argv, log_dir, env)
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            stack.port = int(url.rsplit(":", 1)[1])
            stack.wait_healthy()
    except BaseException:
        stack.stop()
        raise
    return stack, urls


def health_status(base_url: str) -> int | None:
    try:
        return httpx.get(f"{base_url}/health", timeout=2.0).status_code
    except httpx.HTTPError:
        return None


def generate(stack: Stack) -> dict:
    """One greedy `/generate` through the stack's tokenizer; must answer 200."""
    response = httpx.post(f"{stack.base_url}/generate", json=generate_body(), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def generate_body(text: str = "def add(a, b):", max_new_tokens: int = 16, **extra: object) -> dict[str, object]:
    return {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, **extra}
