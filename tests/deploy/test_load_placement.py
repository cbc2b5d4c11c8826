"""Load-aware placement: two CPU schedulers, one made slower, a flood of requests. A scheduler
takes a claim only while it has room, so the slow one, full for longer, takes measurably fewer,
and every output equals the same request's solo run.

The slow scheduler is slowed from outside, without a test-only code path: a thread stops and
continues its process (SIGSTOP 190 ms, SIGCONT 10 ms: it runs a twentieth of the time, slower
than the other even on a machine whose cores are all busy; its heartbeats, every 0.5 s of wall
time against a 2 s timeout, still arrive).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from e2e.stack import Service, Stack, generate_body
from services.common.nats_server import free_port, start_nats_server

MAX_RUNNING = 2  # per scheduler: the flood keeps both full
NUM_REQUESTS = 24
NUM_DISTINCT = 8  # prompts, each sent three times in the flood
MAX_NEW_TOKENS = 16
# A slowed process on a machine whose cores are busy may stay silent past the default 2 s; and
# on such a machine a request may wait for room longer than the default 30 s before it is forced
# onto any scheduler, which would measure chance instead of placement.
ENV = {"SPARKWIRE_HEARTBEAT_TIMEOUT_S": "6"}
CLAIM_WAIT_S = "240"


def duty_cycle(pid: int, stop: threading.Event, off_s: float = 0.19, on_s: float = 0.01) -> None:
    while not stop.is_set():
        os.kill(pid, signal.SIGSTOP)
        stop.wait(off_s)
        os.kill(pid, signal.SIGCONT)
        stop.wait(on_s)
    os.kill(pid, signal.SIGCONT)


def requests_taken(service: Service) -> int:
    return service.log_path.read_text(errors="replace").count("scheduler.request_added")


def generate(base_url: str, prompt: str) -> str:
    body = generate_body(text=prompt, max_new_tokens=MAX_NEW_TOKENS)
    response = httpx.post(f"{base_url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["text"]


@pytest.mark.timeout(300)
def test_a_flood_is_spread_by_load_and_outputs_equal_solo_runs(tmp_path):
    stack = Stack(start_nats_server(), tmp_path, port=free_port())
    scheduler_argv = ["--max-running-requests", str(MAX_RUNNING), "--device", "cpu"]
    try:
        for name in ("fast", "slow"):
            argv = [sys.executable, "-m", "services.cli", "scheduler", "--nats-url", stack.nats.url, *scheduler_argv]
            stack.services[f"scheduler-{name}"] = Service.start(f"scheduler-{name}", argv, tmp_path, env=ENV)
        for name, extra in (("detokenizer", []), ("tokenizer", ["--port", str(stack.port), "--claim-wait-s", CLAIM_WAIT_S])):
            argv = [sys.executable, "-m", "services.cli", name, "--nats-url", stack.nats.url, *extra]
            stack.services[name] = Service.start(name, argv, tmp_path, env=ENV)
        stack.wait_healthy()
        distinct = [f"def task_{index}(n):" for index in range(NUM_DISTINCT)]
        solo = {prompt: generate(stack.base_url, prompt) for prompt in distinct}  # one at a time
        prompts = [distinct[index % NUM_DISTINCT] for index in range(NUM_REQUESTS)]
        before = {name: requests_taken(stack.services[f"scheduler-{name}"]) for name in ("fast", "slow")}

        stop = threading.Event()
        slowing = threading.Thread(target=duty_cycle, args=(stack.services["scheduler-slow"].process.pid, stop))
        slowing.start()
        try:
            with ThreadPoolExecutor(NUM_REQUESTS) as pool:
                flooded = list(pool.map(lambda prompt: generate(stack.base_url, prompt), prompts))
        finally:
            stop.set()
            slowing.join()

        taken = {name: requests_taken(stack.services[f"scheduler-{name}"]) - before[name] for name in ("fast", "slow")}
        print(f"requests taken during the flood: {taken}")
        assert taken["fast"] + taken["slow"] == NUM_REQUESTS, taken
        assert taken["slow"] <= 0.6 * taken["fast"], f"not spread by load: {taken}\n{stack.logs()}"
        assert flooded == [solo[prompt] for prompt in prompts]
    finally:
        stack.stop()
