"""New weights without a restart (issue 45): how long an update takes from disk and over NATS, the
first token after it, against restarting the scheduler on the same weights; NATS throughput into
one scheduler.

The 8B shape (Qwen3-8B's config, dummy bf16 weights written as safetensors into a temporary
directory) on one GPU; `--tiny`: the bundled model on the CPU (the smoke configuration CI runs).
Phases, each skipped once `--budget-s` is spent: write the weights; start nats-server, a
detokenizer and a tokenizer; start the scheduler and wait for /health (the restart); one
1-token /generate (TTFT); POST /update_weights_from_disk with the same directory; TTFT; push the
same tensors with `WeightPusher` over loopback NATS, twice (the first push, then the steady state
of an RL loop); TTFT; release the KV cache and the weights and resume (memory freed, measured by
the scheduler); TTFT.

`--nats-only SIZE_GB`: no model, no GPU. Pushes of a synthetic bf16 state dict of about SIZE_GB
into one receiver process that runs the scheduler's side of a push (its transport, the staging of
pieces in `PushedVersions`, the checks and the copy into served tensors of a commit) on a
nats-server with the project's config; GB/s of each push, the first (staging allocated) and the
steady state of an RL loop. `--into-scheduler DEVICE`: the same pushes alternately into that
receiver and into a real scheduler (refusing each commit: the names are not its model's), so what a
scheduler's process costs its intake shows. `--before DIR` runs DIR's own copy of this script too, alternating;
`--connections 1,4` pushes over each number of NATS connections in turn (the pusher's default:
one per 4 cores, 1 to 4), alternating.

    sparkwire bench rl-weights --out ops/bench/results/rl_weights.json --budget-s 270
    sparkwire bench rl-weights --nats-only 1 --before /tmp/before --rounds 3   # -> results/rl_weights_cpu.json
    sparkwire bench rl-weights --nats-only 2 --connections 1,4 --rounds 2      # one connection against four
    sparkwire bench rl-weights --nats-only 16 --into-scheduler cuda --rounds 3  # the bare receiver against a scheduler holding the 8B shape
    sparkwire bench rl-weights --nats-only 1 --into-scheduler cpu --profile-scheduler /tmp/spy.txt   # and where the scheduler's GIL goes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ops.bench.common import script, write_json
from ops.bench.gpu_serve_check import serving_model_dir
from ops.bench.serve_launch import LoggedProcess, health_ok
from services.common.nats_server import free_port, start_nats_server
from services.models import BUNDLED_MODEL

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "ops/bench/results"
SHAPE = REPO / "ops/model_configs/Qwen3-8B"
SHARD_BYTES = 4 << 30
PERIOD = 4_000_037  # dummy values repeat with this period: drawing billions would dominate the run
READY_TIMEOUT_S = 600.0
PROMPT = "def fibonacci(n):"
NATS_PUSHES = 3  # the first allocates the receiver's staging; the rest are an RL loop's steady state
RECEIVER_ID = "bench-receiver"
HIDDEN = 2048  # the synthetic state dict's width: a small transformer's tensor sizes, 4 KiB norms to 24 MiB MLPs


def write_dummy_weights(model_dir: Path) -> int:
    """bf16 safetensors shards for every tensor the model reads; the bytes written."""
    import torch
    from safetensors.torch import save_file

    from services.scheduler.model.config import ModelConfig
    from services.scheduler.model.registry import build_model

    with torch.device("meta"):
        model = build_model(ModelConfig.from_pretrained(model_dir)).to(torch.bfloat16)
    period = (torch.randn(PERIOD, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    shard, size, index, total = {}, 0, 0, 0
    for name, meta in model.checkpoint_tensors():
        numel = meta.numel()
        shard[name] = period.repeat(-(-numel // PERIOD))[:numel].view(meta.shape).clone()
        size += 2 * numel
        if size >= SHARD_BYTES:
            save_file(shard, str(model_dir / f"model-{index:05d}.safetensors"))
            shard, size, index, total = {}, 0, index + 1, total + size
    if shard:
        save_file(shard, str(model_dir / f"model-{index:05d}.safetensors"))
    return total + size


class Stack:
    """nats-server, a detokenizer, a tokenizer and (restartable) one scheduler, logs in `log_dir`."""

    def __init__(self, model_dir: Path, device: str, log_dir: Path) -> None:
        self.model_dir, self.device, self.log_dir = model_dir, device, log_dir
        self.nats = start_nats_server()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.processes: dict[str, LoggedProcess] = {}

    def start(self, name: str, *args: str) -> LoggedProcess:
        argv = [sys.executable, "-m", "services.cli", name, "--nats-url", self.nats.url, "--model", str(self.model_dir), *args]
        self.processes[name] = LoggedProcess.start(name, argv, self.log_dir / f"{name}.log", append=True)
        return self.processes[name]

    def restart_scheduler_s(self) -> float:
        """Seconds from starting a scheduler until /health answers 200 (load, graphs, join)."""
        began = time.perf_counter()
        self.start("scheduler", "--device", self.device)
        self.processes["scheduler"].wait_until(lambda: health_ok(self.base_url), READY_TIMEOUT_S, "/health not 200")
        return time.perf_counter() - began

    def close(self) -> None:
        for process in reversed(list(self.processes.values())):
            process.stop(60.0)
        self.nats.stop()


def ttft_s(base_url: str) -> float:
    """One greedy 1-token /generate: the time to its first (only) token."""
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    began = time.perf_counter()
    response = httpx.post(f"{base_url}/generate", json=body, timeout=READY_TIMEOUT_S)
    response.raise_for_status()
    return time.perf_counter() - began


def update_from_disk(base_url: str, model_dir: Path) -> dict:
    began = time.perf_counter()
    response = httpx.post(f"{base_url}/update_weights_from_disk", json={"model_path": str(model_dir), "weight_version": "disk-1"},
                          timeout=READY_TIMEOUT_S)  # fmt: skip
    seconds = time.perf_counter() - began
    response.raise_for_status()
    return {"update_s": seconds, "scheduler_s": response.json()["schedulers"][0]["seconds"]}


def release_and_resume(base_url: str) -> dict:
    """Free the KV cache and the weights (kept on the host), then take them back: the measured bytes freed, and each time."""
    began = time.perf_counter()
    released = httpx.post(f"{base_url}/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}, timeout=READY_TIMEOUT_S)
    middle = time.perf_counter()
    resumed = httpx.post(f"{base_url}/resume_memory_occupation", timeout=READY_TIMEOUT_S)
    released.raise_for_status()
    resumed.raise_for_status()
    return {"freed_bytes": released.json()["schedulers"][0]["freed_bytes"], "release_s": middle - began,
            "resume_s": time.perf_counter() - middle}  # fmt: skip


def push_over_nats(nats_url: str, model_dir: Path, limit_s: float, connections: int | None) -> dict:
    """The same tensors pushed to the one scheduler twice: the first push (the scheduler allocates
    its staging buffers) and the second (an RL loop's steady state, into the same buffers). A
    push still running after `limit_s` is cut off (the scheduler keeps its weights) and reported
    with the bytes per second it could not beat. Each push's time splits into its pieces' travel
    (`pieces_s`: until the commit was sent and answered, less the commit) and the scheduler's commit
    (`commit_s`, from its reply: every buffer settled, shapes checked, the copy into the weights)."""
    import uvloop

    from services.weights.__main__ import load_checkpoint
    from services.weights.push import WeightPusher

    tensors = load_checkpoint(model_dir)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    deadline = time.monotonic() + limit_s

    async def push() -> list[tuple[float, float]]:
        pushes = []  # (seconds, the scheduler's commit seconds)
        async with await WeightPusher.connect(nats_url, connections) as pusher:
            ids = await pusher.schedulers()
            for index in range(2):
                if pushes and time.monotonic() + 1.5 * pushes[0][0] > deadline:
                    break
                began = time.perf_counter()
                try:
                    replies = await asyncio.wait_for(pusher.push(tensors, f"nats-{index + 1}", scheduler_ids=ids), deadline - time.monotonic())
                except TimeoutError:
                    if not pushes:
                        raise
                    break  # the first push's figure stands
                pushes.append((time.perf_counter() - began, max(reply.seconds for reply in replies.values())))
        return pushes

    try:
        pushes = uvloop.run(push())
    except TimeoutError:
        return {"timed_out_s": limit_s, "bytes": num_bytes, "gb_per_s_below": num_bytes / limit_s / 1e9}
    (first, commit), steady = pushes[0], {}
    if len(pushes) > 1:
        (seconds, steady_commit) = pushes[1]
        steady = {"steady_update_s": seconds, "steady_gb_per_s": num_bytes / seconds / 1e9, "steady_commit_s": steady_commit,
                  "steady_pieces_s": seconds - steady_commit}  # fmt: skip
    return {"update_s": first, "bytes": num_bytes, "gb_per_s": num_bytes / first / 1e9, "commit_s": commit,
            "pieces_s": first - commit} | steady  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    deadline = time.monotonic() + args.budget_s
    result: dict = {"device": args.device, "shape": "bundled" if args.tiny else args.model_config.name, "budget_s": args.budget_s, "skipped": []}

    def phase(name: str, fn):  # type: ignore[no-untyped-def]
        if time.monotonic() > deadline:
            result["skipped"].append(name)
            return None
        result[name] = fn()
        return result[name]

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        if args.tiny:
            shutil.copytree(BUNDLED_MODEL, model_dir, ignore=shutil.ignore_patterns("training"))
            result["weight_bytes"] = (model_dir / "model.safetensors").stat().st_size
        else:
            serving_model_dir(args.model_config, model_dir)
            began = time.perf_counter()
            result["weight_bytes"] = write_dummy_weights(model_dir)
            result["write_s"] = time.perf_counter() - began
        stack = Stack(model_dir, args.device, Path(tmp))
        try:
            stack.start("detokenizer")
            stack.start("tokenizer", "--port", str(stack.port))
            phase("restart_s", stack.restart_scheduler_s)
            phase("ttft_after_restart_s", lambda: ttft_s(stack.base_url))
            phase("ttft_warm_s", lambda: ttft_s(stack.base_url))
            phase("disk", lambda: update_from_disk(stack.base_url, model_dir))
            phase("ttft_after_disk_s", lambda: ttft_s(stack.base_url))
            phase("nats", lambda: push_over_nats(stack.nats.url, model_dir, max(30.0, deadline - time.monotonic() + 30.0), args.connections[0]))
            phase("ttft_after_nats_s", lambda: ttft_s(stack.base_url))
            phase("memory", lambda: release_and_resume(stack.base_url))
            phase("ttft_after_resume_s", lambda: ttft_s(stack.base_url))
        except Exception:
            print("\n".join(process.log_tail() for process in stack.processes.values()), file=sys.stderr)
            raise
        finally:
            stack.close()
    restart = result.get("restart_s")
    for kind in ("disk", "nats"):
        if restart and "update_s" in result.get(kind, {}):
            result[kind]["vs_restart"] = result[kind]["update_s"] / restart
    return result


def table(result: dict) -> str:
    rows = [("restart of the scheduler (to /health 200)", result.get("restart_s"), None)]
    for kind in ("disk", "nats"):
        entry = result.get(kind) or {}
        rows.append((f"update over {kind}", entry.get("update_s"), entry.get("vs_restart")))
    lines = [f"{'what':44} {'seconds':>9} {'x restart':>10}"]
    lines += [f"{what:44} {'-' if s is None else f'{s:9.2f}':>9} {'-' if r is None else f'{r:10.3f}':>10}" for what, s, r in rows]
    ttfts = ", ".join(f"{k.removeprefix('ttft_').removesuffix('_s')} {result[k]:.3f}" for k in result if k.startswith("ttft_"))
    lines.append(f"TTFT (s): {ttfts}")
    if "gb_per_s" in result.get("nats", {}):
        nats = result["nats"]
        steady = f", the second push {nats['steady_gb_per_s']:.2f} GB/s" if "steady_gb_per_s" in nats else ""
        lines.append(f"NATS into one scheduler: {nats['gb_per_s']:.2f} GB/s ({nats['bytes'] / 1e9:.2f} GB){steady}")
        split = [f"{name} push: pieces {nats[p + 'pieces_s']:.2f} s + commit {nats[p + 'commit_s']:.2f} s"
                 for name, p in (("first", ""), ("second", "steady_")) if p + "commit_s" in nats]  # fmt: skip
        lines.append("; ".join(split))
    elif "nats" in result:
        lines.append(f"NATS push cut off after {result['nats']['timed_out_s']:.0f} s: below {result['nats']['gb_per_s_below']:.2f} GB/s")
    if "memory" in result:
        memory = result["memory"]
        lines.append(f"release: {memory['freed_bytes'] / 1e9:.2f} GB freed in {memory['release_s']:.2f} s, resume {memory['resume_s']:.2f} s")
    if result["skipped"]:
        lines.append(f"skipped (budget): {', '.join(result['skipped'])}")
    return "\n".join(lines)


def synthetic_shapes(size_gb: float) -> dict[str, tuple[int, ...]]:
    """Shapes of about `size_gb` GB of bf16 tensors: an embedding, then layers of a HIDDEN-wide transformer."""
    layer = {"input_layernorm.weight": (HIDDEN,), "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
             "self_attn.k_proj.weight": (HIDDEN // 4, HIDDEN), "self_attn.v_proj.weight": (HIDDEN // 4, HIDDEN),
             "self_attn.o_proj.weight": (HIDDEN, HIDDEN), "post_attention_layernorm.weight": (HIDDEN,),
             "mlp.gate_proj.weight": (3 * HIDDEN, HIDDEN), "mlp.up_proj.weight": (3 * HIDDEN, HIDDEN),
             "mlp.down_proj.weight": (HIDDEN, 3 * HIDDEN)}  # fmt: skip
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (32768, HIDDEN)}
    while 2 * sum(math.prod(shape) for shape in shapes.values()) < size_gb * 1e9:
        index = len(shapes) // len(layer)
        shapes |= {f"model.layers.{index}.{name}": shape for name, shape in layer.items()}
    return shapes


def synthetic_state_dict(size_gb: float):
    """(shapes, bf16 tensors, their bytes) of about `size_gb` GB: what `--nats-only` pushes."""
    import torch

    shapes = synthetic_shapes(size_gb)
    tensors = {name: torch.empty(shape, dtype=torch.bfloat16).fill_(index % 7 - 3) for index, (name, shape) in enumerate(shapes.items())}
    return shapes, tensors, sum(t.numel() * t.element_size() for t in tensors.values())


def start_receiver(shapes: dict[str, tuple[int, ...]]):
    """A nats-server and the bare receiver process (`receive`) on it, returned once it is subscribed."""
    nats = start_nats_server()
    code = "import sys; from ops.bench.rl_weights import receive; receive(sys.argv[1], sys.argv[2])"
    receiver = subprocess.Popen([sys.executable, "-c", code, nats.url, json.dumps(shapes)], stdout=subprocess.PIPE, text=True, cwd=REPO,
                                env=os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))})  # fmt: skip
    if receiver.stdout is None or receiver.stdout.readline().strip() != "ready":
        receiver.kill()
        nats.stop()
        raise RuntimeError(f"the receiver did not start (exit {receiver.wait()})")
    return nats, receiver


def receive(url: str, shapes_json: str) -> None:
    """The receiver process of `--nats-only`: prints "ready" once subscribed, then serves pushes until killed."""
    from services.common.lifecycle import run_event_loop

    run_event_loop(_receive(url, {name: tuple(shape) for name, shape in json.loads(shapes_json).items()}))


async def _receive(url: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """A scheduler's weights subject without a model, handled as `SchedulerControls._on_weights`
    handles it; its swap is the copy into served tensors (host tensors here)."""
    import torch

    from contracts import subjects
    from contracts.weights import ControlReply, WeightManifest, WeightMessage, WeightPiece
    from services.common.transport import Transport
    from services.scheduler.weights.pieces import PushedVersions
    from services.scheduler.weights.tensors import check_shapes, copy_weights

    served = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}
    transport = await Transport.connect(url, RECEIVER_ID)
    pushed = PushedVersions()

    async def on_weights(message, msg) -> None:  # type: ignore[no-untyped-def]
        if isinstance(message, WeightManifest):
            pushed.plan(message)
            return
        if isinstance(message, WeightPiece):
            await asyncio.to_thread(pushed.add, message, msg.missed)
            return
        began = time.perf_counter()
        try:
            tensors = pushed.take(message)
            check_shapes(served, pushed.shapes(tensors))
            copy_weights(served, tensors)
            reply = ControlReply(RECEIVER_ID, weight_version=message.weight_version or "", seconds=time.perf_counter() - began)
        except Exception as exc:  # refused: reported to the pusher, as the scheduler does
            reply = ControlReply(RECEIVER_ID, ok=False, error=str(exc)[:4096])
        finally:
            pushed.recycle()
        await transport.respond(msg, reply)

    await transport.subscribe(subjects.scheduler_weights(RECEIVER_ID), WeightMessage, on_weights)
    await transport.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


def nats_only(size_gb: float, connections: int | None = None) -> dict:
    """`NATS_PUSHES` pushes of the synthetic state dict into one receiver process over `connections`
    (None: the pusher's default); seconds and GB/s of each."""
    import uvloop

    from ops.bench.logprob_transport import ProcessMeter
    from services.weights.push import WeightPusher

    shapes, tensors, num_bytes = synthetic_state_dict(size_gb)
    nats, receiver = start_receiver(shapes)

    meter = ProcessMeter({"pusher": os.getpid(), "receiver": receiver.pid, "nats-server": nats.process.pid})
    cpu: dict[str, float] = {}
    used_connections = []

    async def push() -> list[dict]:
        runs = []
        async with await WeightPusher.connect(nats.url, connections) as pusher:
            used_connections.append(len(pusher.transports))
            for index in range(NATS_PUSHES):
                before = meter.read()
                began = time.perf_counter()
                replies = await pusher.push(tensors, f"bench-{index}", scheduler_ids=[RECEIVER_ID])
                seconds = time.perf_counter() - began
                runs.append({"seconds": seconds, "gb_per_s": num_bytes / seconds / 1e9, "swap_s": replies[RECEIVER_ID].seconds})
                if index:  # the steady pushes: where each process spends its CPU
                    for name, used in meter.per_run(before, meter.read(), 1).items():
                        cpu[name] = cpu.get(name, 0.0) + used["cpu_ms"] / 1e3 / (num_bytes / 1e9) / (NATS_PUSHES - 1)
        return runs

    try:
        pushes = uvloop.run(push())
    finally:
        receiver.kill()
        receiver.wait()
        nats.stop()
    return {"size_gb": size_gb, "bytes": num_bytes, "num_tensors": len(tensors), "connections": used_connections[0], "pushes": pushes, "cpu_s_per_gb": cpu,
            "first_gb_per_s": pushes[0]["gb_per_s"], "steady_gb_per_s": max(p["gb_per_s"] for p in pushes[1:])}  # fmt: skip


def compare(before_tree: Path, size_gb: float, rounds: int) -> dict:
    """`--nats-only` on the other tree and this one alternately, `rounds` times each; each tree's best round."""
    from ops.bench.other_tree import alternate  # the parent's only: the child imports from the other tree

    trees = {"before": before_tree, "after": REPO}
    runs = alternate(__file__, trees, ["--nats-only", str(size_gb)], rounds)
    return {name: max(results, key=lambda r: r["steady_gb_per_s"]) | {"tree": str(trees[name]), "rounds": results}
            for name, results in runs.items()}  # fmt: skip


def by_connections(size_gb: float, counts: list[int], rounds: int) -> dict:
    """`--nats-only` over each number of pusher connections in turn, `rounds` times; each count's best round."""
    runs: dict[int, list[dict]] = {count: [] for count in counts}
    for _ in range(rounds):
        for count in counts:
            runs[count].append(nats_only(size_gb, count))
    return {f"{count} conn": max(results, key=lambda r: r["steady_gb_per_s"]) | {"rounds": results} for count, results in runs.items()}


def receiver_vs_scheduler(size_gb: float, device: str, model_config: Path, rounds: int, profile: Path | None = None) -> dict:
    """The same synthetic tensors pushed into the bare receiver and into a real scheduler (`sparkwire
    scheduler` on `device`: the bundled model on the CPU, `model_config`'s shape with dummy weights on
    CUDA), alternating, `rounds` pushes each. The scheduler refuses each commit (the names are not its
    model's), so a push's seconds are its pieces' travel and the scheduler's intake: what its process
    does beside a push (a model on the device, its other subscriptions, its step thread) shows as the
    difference from the receiver. profile: py-spy the scheduler's GIL over the pushes (raw samples
    there; `scheduler_profile`'s summary in the result)."""
    import uvloop

    from ops.bench import scheduler_profile
    from services.weights.push import PushFailed, WeightPusher

    if profile is not None:
        scheduler_profile.py_spy()  # missing: fail before anything starts
    shapes, tensors, num_bytes = synthetic_state_dict(size_gb)
    nats, receiver = start_receiver(shapes)
    tmp = Path(tempfile.mkdtemp(prefix="sparkwire-intake-"))
    model = BUNDLED_MODEL if device == "cpu" else serving_model_dir(model_config, tmp / "model")
    dummy = [] if device == "cpu" else ["--load-format", "dummy"]
    scheduler = LoggedProcess.start("scheduler", [sys.executable, "-m", "services.cli", "scheduler", "--nats-url", nats.url, "--model", str(model),
                                                  "--device", device, *dummy], tmp / "scheduler.log")  # fmt: skip
    seconds: dict[str, list[float]] = {"receiver": [], "scheduler": []}
    refusals: list[str] = []  # the scheduler's: a model mismatch at the commit means every piece arrived

    async def push() -> dict | None:
        """The pushes; py-spy's summary of them (None without `profile`)."""
        async with await WeightPusher.connect(nats.url) as pusher:
            found: list[str] = []
            waited = time.monotonic() + READY_TIMEOUT_S
            while not found and time.monotonic() < waited:
                found = [sid for sid in await pusher.schedulers(1.0) if sid != RECEIVER_ID]
            if not found:
                raise RuntimeError(f"the scheduler did not join:\n{scheduler.log_tail()}")
            targets = {"receiver": RECEIVER_ID, "scheduler": found[0]}
            recording = None if profile is None else scheduler_profile.Recording.start(scheduler.process.pid, profile)
            began_all = time.perf_counter()
            for index in range(rounds):
                for name in (("receiver", "scheduler") if index % 2 == 0 else ("scheduler", "receiver")):
                    began = time.perf_counter()
                    try:
                        await pusher.push(tensors, f"{name}-{index}", scheduler_ids=[targets[name]])
                    except PushFailed as refused:  # the scheduler's commit: not its model's names
                        refusals.append(str(refused))
                    seconds[name].append(time.perf_counter() - began)
            return None if recording is None else recording.stop(time.perf_counter() - began_all)

    try:
        spied = uvloop.run(push())
    finally:
        receiver.kill()
        receiver.wait()
        scheduler.stop(60.0)
        nats.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"size_gb": size_gb, "bytes": num_bytes, "scheduler_device": device, "seconds": seconds, "refusals": refusals,
              "gb_per_s": {name: [round(num_bytes / s / 1e9, 3) for s in runs] for name, runs in seconds.items()}}  # fmt: skip
    return result if spied is None else result | {"scheduler_profile": spied}


def nats_table(results: dict[str, dict]) -> str:
    lines = [f"{'tree':8} {'conns':>5} {'GB':>6} {'first push GB/s':>16} {'steady GB/s':>12} {'swap s':>7}  CPU s per GB (steady)"]
    for name, r in results.items():
        cpu = ", ".join(f"{process} {seconds:.2f}" for process, seconds in r.get("cpu_s_per_gb", {}).items())
        lines.append(f"{name:8} {r.get('connections', 1):>5} {r['bytes'] / 1e9:6.2f} {r['first_gb_per_s']:16.3f} {r['steady_gb_per_s']:12.3f} {r['pushes'][-1]['swap_s']:7.3f}  {cpu}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="default: results/rl_weights.json, with --nats-only results/rl_weights_cpu.json")
    parser.add_argument("--budget-s", type=float, default=270.0, help="no phase starts after this many seconds")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the bundled model instead of the 8B shape (CPU smoke)")
    parser.add_argument("--model-config", type=Path, default=SHAPE, help="the shape's config directory (dummy weights)")
    parser.add_argument("--nats-only", type=float, metavar="SIZE_GB", help="only push GB/s into one receiver, no model (CPU)")
    parser.add_argument("--before", type=Path, help="with --nats-only: another tree's copy of this script too, alternating")
    parser.add_argument("--rounds", type=int, default=3, help="with --before or several --connections: rounds of each")
    parser.add_argument("--connections", type=lambda text: [int(n) for n in text.split(",")], default=[None], metavar="N[,M...]",
                        help="NATS connections the pusher stripes pieces over (default: its own, from the CPU count); several: each in turn")  # fmt: skip
    parser.add_argument("--into-scheduler", choices=("cpu", "cuda"), help="with --nats-only: the bare receiver against a real scheduler on this device, alternating")
    parser.add_argument("--profile-scheduler", type=Path, metavar="RAW", help="with --into-scheduler: py-spy the scheduler's GIL over the pushes into RAW (needs py-spy)")
    parser.add_argument("--print-json", action="store_true", help=argparse.SUPPRESS)  # a subprocess's output


def main(args: argparse.Namespace) -> int:
    args.out = args.out or RESULTS / ("rl_weights.json" if args.nats_only is None else "rl_weights_cpu.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.nats_only is not None:
        return main_nats_only(args)
    result = run(args)
    write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}), file=sys.stderr)
    print(table(result))
    return 0


def main_nats_only(args: argparse.Namespace) -> int:
    if args.into_scheduler is not None:
        result = receiver_vs_scheduler(args.nats_only, args.into_scheduler, args.model_config, args.rounds, args.profile_scheduler)
        for name, rates in result["gb_per_s"].items():
            print(f"{name:9} GB/s by push: {', '.join(f'{rate:.3f}' for rate in rates)}")
        if "scheduler_profile" in result:
            print(json.dumps(result["scheduler_profile"], indent=1)[:3000])
    elif args.before is not None:
        result = compare(args.before.resolve(), args.nats_only, args.rounds)
        print(nats_table(result))
    elif len(args.connections) > 1:
        result = by_connections(args.nats_only, args.connections, args.rounds)
        print(nats_table(result))
    else:
        result = nats_only(args.nats_only, args.connections[0])
        if args.print_json:
            print(json.dumps(result))
            return 0
        print(nats_table({"this": result}))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
