"""RL loops on the real stack (issue 45): new weights without a restart, from disk and over NATS,
on two schedulers; in-flight requests finish on the old weights or abort; refused versions leave
the old weights serving; release/resume frees the KV cache and changes no answer.

A is the bundled model (what the stack serves at start), B its weights plus seeded noise, each a
safetensors directory; "a fresh server on B" is a scheduler started on B's directory.
"""

from __future__ import annotations

import os
import re
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from contracts.weights import WeightCommit, WeightTarget
from e2e.reference import merge_events
from e2e.stack import Service, Stack, generate_body, service_argv, start_replicas
from services.models import BUNDLED_MODEL
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.kv_cache import bytes_per_block
from services.scheduler.model.loader import _default_num_blocks
from services.weights.push import WeightPusher, pieces

TOL = 1e-5
CONFIG = ModelConfig.from_pretrained(BUNDLED_MODEL)
KV_BUDGET_BYTES = _default_num_blocks(CONFIG, 16, torch.float32, torch.device("cpu"), None) * bytes_per_block(CONFIG, 16, torch.float32)
LONG = 96  # tokens of an in-flight request: many steps, so the update lands mid-request
ENDLESS = 4096  # an in-flight request that an abort must end: it is still running whatever the machine's load


def save_weights(directory: Path, seed: int | None, **reshape: tuple[int, ...]) -> Path:
    """The bundled model's config and tokenizer; its weights plus N(0, 0.02) noise drawn from `seed`."""
    shutil.copytree(BUNDLED_MODEL, directory, ignore=shutil.ignore_patterns("training"))
    tensors = load_file(str(BUNDLED_MODEL / "model.safetensors"))
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        tensors = {name: t + 0.02 * torch.randn(t.shape, generator=generator).to(t.dtype) for name, t in tensors.items()}
    for name, shape in reshape.items():
        tensors[name.replace("__", ".")] = torch.zeros(shape)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    bad = {"model__norm__weight": (7,)}
    return {"A": save_weights(root / "A", None), "B": save_weights(root / "B", 1), "bad": save_weights(root / "bad", 1, **bad)}


@pytest.fixture(scope="module")
def rl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    stack, urls = start_replicas(tmp_path_factory.mktemp("rl-logs"), count=1, schedulers=2)
    yield stack, urls[0]
    stack.stop()


def gen(url: str, text: str = "def add(a, b):", max_new_tokens: int = 12) -> dict:
    body = generate_body(text, max_new_tokens, return_logprob=True, top_logprobs_num=2)
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def only_fresh_alive(url: str, timeout_s: float = 120.0) -> None:
    """Wait until the tokenizer's live schedulers are the one named "fresh": the stopped ones' last
    heartbeats expired, so the next request cannot wait on one of them (a loaded machine can stop
    them slower than it starts the fresh one)."""
    deadline, instances = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        instances = httpx.get(f"{url}/health", params={"verbose": ""}, timeout=30).json()["services"]["scheduler"]["instances"]
        if instances == ["fresh"]:
            return
        time.sleep(0.25)
    raise AssertionError(f"live schedulers after {timeout_s}s: {instances}")


def post(url: str, path: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/{path}", json=body, timeout=300)


def same_answer(got: dict, want: dict) -> None:
    """Ids equal, every output logprob (and top-2 entry) within TOL."""
    assert got["output_ids"] == want["output_ids"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        flat_got = re.findall(r"-?\d+\.\d+(?:e-?\d+)?", str(got["meta_info"][key]))
        flat_want = re.findall(r"-?\d+\.\d+(?:e-?\d+)?", str(want["meta_info"][key]))
        assert len(flat_got) == len(flat_want) > 0
        assert max(abs(float(a) - float(b)) for a, b in zip(flat_got, flat_want)) <= TOL


def streamed(url: str, text: str, max_new_tokens: int, started: threading.Event) -> dict:
    """A streamed /generate folded into one answer (EOS ignored: it runs max_new_tokens unless ended);
    `started` is set at its first event."""
    body = generate_body(text, max_new_tokens, return_logprob=True, top_logprobs_num=2, stream=True)
    body["sampling_params"]["ignore_eos"] = True
    events = []
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and (payload := line.removeprefix("data:").strip()) != "[DONE]":
                events.append(json.loads(payload))
                started.set()
    return merge_events(events)


def while_updating(url: str, path: str, tokens: int = LONG, **body: object) -> tuple[list[dict], httpx.Response]:
    """Four requests of `tokens` streaming (each has its first token), then the update: their answers and the update's."""
    started = [threading.Event() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        flying = [pool.submit(streamed, url, f"x = {i} +", tokens, started[i]) for i in range(4)]
        assert all(event.wait(60) for event in started)
        update = post(url, path, **body)
        return [f.result() for f in flying], update


@pytest.mark.timeout(300)
def test_update_from_disk_swaps_every_scheduler_between_steps(rl, weights):
    stack, url = rl
    on_a = gen(url)
    assert on_a["meta_info"]["weight_version"] == "0"
    alone_on_a = [gen(url, f"x = {i} +", LONG) for i in range(4)]
    flown, update = while_updating(url, "update_weights_from_disk", model_path=str(weights["B"]), weight_version="B1")
    assert update.status_code == 200, update.text
    assert [s["weight_version"] for s in update.json()["schedulers"]] == ["B1", "B1"]  # both swapped
    for got, alone in zip(flown, alone_on_a):  # finished on A, none short
        assert got["meta_info"]["weight_version"] == "0"
        assert got["meta_info"]["completion_tokens"] == LONG
        same_answer(got, alone)
    on_b = [gen(url) for _ in range(4)]  # spread over both schedulers
    assert {answer["meta_info"]["weight_version"] for answer in on_b} == {"B1"}
    assert all(answer["output_ids"] == on_b[0]["output_ids"] for answer in on_b)
    assert on_b[0]["output_ids"] != on_a["output_ids"]
    assert httpx.get(f"{url}/get_model_info").json()["weight_version"] == "B1"
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
    assert chat.json()["system_fingerprint"] == "B1"
    stack.raise_if_dead()


@pytest.mark.timeout(120)
def test_mismatch_is_a_400_naming_the_tensor_and_the_old_weights_serve(rl, weights):
    _, url = rl
    before = gen(url)
    refused = post(url, "update_weights_from_disk", model_path=str(weights["bad"]), weight_version="bad")
    assert refused.status_code == 400
    assert "model.norm.weight" in refused.json()["error"]["message"]
    after = gen(url)
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"] != "bad"
    same_answer(after, before)


@pytest.mark.timeout(300)
def test_abort_all_requests_ends_in_flight_requests_with_abort(rl, weights):
    _, url = rl
    flown, update = while_updating(url, "update_weights_from_disk", ENDLESS, model_path=str(weights["A"]), abort_all_requests=True)
    assert update.status_code == 200, update.text
    assert sum(s["num_aborted"] for s in update.json()["schedulers"]) == 4
    for got in flown:
        assert got["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < got["meta_info"]["completion_tokens"] == len(got["output_ids"]) < ENDLESS
    version = update.json()["weight_version"]
    assert version == "2" and gen(url)["meta_info"]["weight_version"] == "2"  # the default: the count of swaps


@pytest.mark.timeout(300)
def test_the_readme_loop_runs(rl):
    """README.md's RL loop, as a user runs it, against this stack."""
    _, url = rl
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"<!-- rl-loop -->\n```python\n(.*?)```\n<!-- /rl-loop -->", readme, re.S).group(1)
    assert len(code.splitlines()) <= 25
    env = {**os.environ, "SPARKWIRE_URL": url, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    ran = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = ran.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["step-1", "step-2"] and lines[-1] == "step-3"


def _checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


@pytest.mark.timeout(300)
async def test_push_weights_over_nats_to_both_schedulers(rl, weights):
    stack, url = rl
    argv = [sys.executable, "-m", "services.cli", "push-weights", "--nats-url", stack.nats.url, str(weights["B"]),
            "--weight-version", "pushed-B", "--connections", "2"]  # fmt: skip
    pushed = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    replies = json.loads(pushed.stdout.splitlines()[-1])
    assert len(replies) == 2 and {r["weight_version"] for r in replies.values()} == {"pushed-B"}
    on_b = gen(url)
    assert on_b["meta_info"]["weight_version"] == "pushed-B"
    await _push_broken(stack, weights["A"], drop=True)
    await _push_broken(stack, weights["A"], drop=False)
    after = gen(url)
    assert after["meta_info"]["weight_version"] == "pushed-B"
    same_answer(after, on_b)


async def _push_broken(stack: Stack, directory: Path, drop: bool) -> None:
    """Push A with one piece dropped or one checksum wrong: every scheduler refuses and says why."""
    tensors = _checkpoint(directory)
    async with await WeightPusher.connect(stack.nats.url) as pusher:
        ids = await pusher.schedulers()
        assert len(ids) == 2
        for sid in ids:
            parts = list(pieces(tensors, f"broken-{sid}", WeightTarget.MODEL, piece_bytes=1 << 16))
            victim = len(parts) // 2
            if drop:
                del parts[victim]
            else:
                parts[victim] = msgspec.structs.replace(parts[victim], xxh3=parts[victim].xxh3 ^ 1)
            commit = WeightCommit(f"broken-{sid}", tuple(tensors), "broken")
            reply = (await pusher.send([sid], iter(parts), commit))[sid]
            assert not reply.ok and reply.weight_version == "pushed-B"
            assert ("checksum" if not drop else "bytes arrived") in reply.error


def _rss(service: Service) -> int:
    with open(f"/proc/{service.process.pid}/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.timeout(180)
def test_release_frees_the_kv_cache_and_resume_changes_no_answer(rl):
    stack, url = rl
    before = gen(url)
    schedulers = [s for name, s in stack.services.items() if name.startswith("scheduler")]
    held = [_rss(s) for s in schedulers]
    released = post(url, "release_memory_occupation", tags=["kv_cache"])
    assert released.status_code == 200, released.text
    freed = [h - _rss(s) for h, s in zip(held, schedulers)]
    assert min(freed) >= KV_BUDGET_BYTES, freed  # measured from outside, per scheduler process
    assert all(s["freed_bytes"] >= KV_BUDGET_BYTES for s in released.json()["schedulers"])
    assert post(url, "resume_memory_occupation").status_code == 200
    same_answer(gen(url), before)


@pytest.mark.timeout(180)
def test_pause_in_place_holds_requests_until_continue(rl):
    _, url = rl
    alone = gen(url, "y = 2 *", 16)
    assert post(url, "pause_generation", mode="in_place").status_code == 200
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(gen, url, "y = 2 *", 16)
        time.sleep(1.5)
        assert not waiting.done()  # held while paused
        assert post(url, "continue_generation").status_code == 200
        same_answer(waiting.result(timeout=60), alone)


@pytest.mark.timeout(180)
def test_pause_with_abort_ends_requests_in_flight(rl):
    _, url = rl
    flown, paused = while_updating(url, "pause_generation", ENDLESS, mode="abort")
    assert paused.status_code == 200, paused.text
    assert all(got["meta_info"]["finish_reason"]["type"] == "abort" for got in flown)
    assert sum(s["num_aborted"] for s in paused.json()["schedulers"]) == 4
    assert post(url, "continue_generation").status_code == 200
    assert gen(url)["meta_info"]["completion_tokens"] == 12


@pytest.mark.timeout(300)
def test_a_fresh_scheduler_on_b_answers_as_the_updated_ones(rl, weights):
    """Last: the pushed schedulers leave, one started on B's directory answers exactly the same."""
    stack, url = rl
    on_b = gen(url)
    for name in [n for n in stack.services if n.startswith("scheduler")]:
        stack.services.pop(name).stop()
    argv = service_argv("scheduler", stack.nats.url, "--model", str(weights["B"]), "--instance-id", "fresh")
    env = {"SPARKWIRE_HEARTBEAT_TIMEOUT_S": "15"}
    stack.services["scheduler-fresh"] = Service.start("scheduler-fresh", argv, stack.log_dir, env)
    stack.wait_healthy()
    only_fresh_alive(url)
    fresh = gen(url)
    assert fresh["meta_info"]["weight_version"] == "0"
    same_answer(fresh, on_b)
