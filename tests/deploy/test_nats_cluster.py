"""Three clustered nats-server nodes (ops/nats/cluster.conf: TLS on client connections and routes,
a user per service kind), the services attached to different nodes, and one node killed mid-run.

The scheduler on node 1, the detokenizer on node 2, the tokenizer on node 3; each lists all three
servers, its own first. Node 1 is killed while every stream is decoding: the scheduler's two
connections fail over to node 2. What it published meanwhile, nats-py sends once reconnected;
what was inside the killed node is lost (core NATS is at-most-once), and the receivers'
per-sender sequence numbers turn such a gap into a clear error for the requests concerned. So
every in-flight request completes with its solo output or ends with a clear error; requests
after the kill succeed; nothing hangs (every wait below is bounded).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from e2e.stack import Service, Stack, generate_body, health_status
from services.common.nats_auth import draw_passwords, server_environ
from services.common.nats_server import CLUSTER_CONFIG, NatsServer, free_port, start_nats_server
from tls_certs import TlsFiles, make_tls_files

NODES = 3
ATTACHED = {"scheduler": 0, "detokenizer": 1, "tokenizer": 2}  # service -> the node it lists first
NUM_INFLIGHT = 4
MAX_NEW_TOKENS = 48


@dataclass
class Cluster:
    nodes: list[NatsServer]
    monitor_ports: list[int]
    tls: TlsFiles
    passwords: dict[str, str]
    killed: set[int] = field(default_factory=set)

    def urls(self, first: int) -> str:
        order = [first] + [index for index in range(NODES) if index != first]
        return ",".join(f"tls://127.0.0.1:{self.nodes[index].port}" for index in order)

    def service_env(self, name: str) -> dict[str, str]:
        """The service's identity and TLS settings, as `sparkwire up` or compose would pass them."""
        return {"SPARKWIRE_NATS_URL": self.urls(ATTACHED[name]), "SPARKWIRE_NATS_TLS_CA": str(self.tls.ca),
                "SPARKWIRE_NATS_USER": name, "SPARKWIRE_NATS_PASSWORD": self.passwords[name]}  # fmt: skip

    def num_routes(self, index: int) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_ports[index]}/routez", timeout=2) as response:
            return json.load(response)["num_routes"]

    def wait_meshed(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        alive = [index for index in range(NODES) if index not in self.killed]
        while any(self.num_routes(index) < len(alive) - 1 for index in alive):
            assert time.monotonic() < deadline, "the nodes did not form a full mesh of routes"
            time.sleep(0.1)

    def kill(self, index: int) -> None:
        self.nodes[index].kill()
        self.killed.add(index)

    def stop(self) -> None:
        for index, node in enumerate(self.nodes):
            if index not in self.killed:
                node.stop()


def start_cluster(tmp_path: Path) -> Cluster:
    tls = make_tls_files(tmp_path / "tls")  # test-only certificates, made now
    passwords = draw_passwords()
    env = server_environ(passwords) | {"SPARKWIRE_NATS_SERVER_CERT": str(tls.server_cert),
                                       "SPARKWIRE_NATS_SERVER_KEY": str(tls.server_key), "SPARKWIRE_NATS_SERVER_CA": str(tls.ca)}  # fmt: skip
    route_ports, monitor_ports = [free_port() for _ in range(NODES)], [free_port() for _ in range(NODES)]
    routes = ",".join(f"nats-route://127.0.0.1:{port}" for port in route_ports)
    nodes = []
    try:
        for index in range(NODES):
            args = ("-n", f"nats-{index + 1}", "--cluster", f"nats://127.0.0.1:{route_ports[index]}", "--routes", routes,
                    "-m", str(monitor_ports[index]))  # fmt: skip
            nodes.append(start_nats_server(CLUSTER_CONFIG, env=env, extra_args=args))
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    cluster = Cluster(nodes, monitor_ports, tls, passwords)
    cluster.wait_meshed()
    return cluster


@pytest.fixture
def clustered_stack(tmp_path: Path) -> Iterator[tuple[Cluster, Stack]]:
    cluster = start_cluster(tmp_path)
    stack = Stack(cluster.nodes[0], tmp_path)  # Stack's own nats-server handling is not used
    try:
        for name in ("scheduler", "detokenizer", "tokenizer"):
            extra = ["--port", str(stack.port)] if name == "tokenizer" else []
            argv = [sys.executable, "-m", "services.cli", name, *extra]
            stack.services[name] = Service.start(name, argv, tmp_path, env=cluster.service_env(name))
        stack.wait_healthy()
        yield cluster, stack
    finally:
        for service in stack.services.values():
            service.stop()
        cluster.stop()


def generate(stack: Stack, prompt: str) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/generate", json=generate_body(text=prompt, max_new_tokens=MAX_NEW_TOKENS), timeout=30)


@dataclass
class StreamedRequest:
    """One streaming /generate in its own thread; `started` once its first event arrived."""

    prompt: str
    events: list[str] = field(default_factory=list)
    status: int | None = None
    started: threading.Event = field(default_factory=threading.Event)

    def run(self, base_url: str) -> None:
        body = generate_body(text=self.prompt, max_new_tokens=MAX_NEW_TOKENS, stream=True)
        try:
            with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=30) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.started.set()
        finally:
            self.started.set()

    def outcome(self) -> tuple[str, str]:
        """("text", the text) for a finished stream, ("error", why) for a clear failure."""
        if self.status != 200:
            return "error", f"HTTP {self.status}"
        assert self.events and self.events[-1] == "[DONE]", f"a stream that neither finished nor failed: {self.events[-3:]}"
        last = json.loads(self.events[-2])
        if "error" in last or last["meta_info"]["finish_reason"]["type"] == "abort":
            return "error", json.dumps(last)[:200]
        return "text", last["text"]


@pytest.mark.timeout(120)
def test_killing_a_node_mid_run_loses_no_request_silently_and_later_requests_succeed(clustered_stack):
    cluster, stack = clustered_stack
    prompts = [f"def f{index}(x):" for index in range(NUM_INFLIGHT)]
    solo = {prompt: generate(stack, prompt).json()["text"] for prompt in prompts}  # also warms the path

    streams = [StreamedRequest(prompt) for prompt in prompts]
    threads = [threading.Thread(target=stream.run, args=(stack.base_url,)) for stream in streams]
    for thread in threads:
        thread.start()
    for stream in streams:
        assert stream.started.wait(30), "a stream never started"
    cluster.kill(ATTACHED["scheduler"])  # every stream is decoding now
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), f"a request hung\n{stack.logs()}"

    for stream in streams:
        kind, value = stream.outcome()
        assert kind == "error" or value == solo[stream.prompt], f"{stream.prompt!r}: a wrong answer presented as complete\n{stack.logs()}"

    cluster.wait_meshed()
    deadline = time.monotonic() + 20
    while health_status(stack.base_url) != 200:
        assert time.monotonic() < deadline, f"the stack did not recover\n{stack.logs()}"
        time.sleep(0.2)
    for prompt in prompts:
        response = generate(stack, prompt)
        assert response.status_code == 200 and response.json()["text"] == solo[prompt], stack.logs()
