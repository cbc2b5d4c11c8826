"""Issue 16: two schedulers on two GPUs behind one NATS, driven by `sparkwire bench serve`.

One nats-server, one tokenizer, one detokenizer, and `--num-schedulers` (2) scheduler processes,
each pinned to its own GPU (`CUDA_VISIBLE_DEVICES=i`), all serving the same dummy-weight shape
(default Qwen3-1.7B, beside the bundled tokenizer). In one run:

1. `one_scheduler`: only scheduler 0 up; concurrency `--concurrency` (64), ignore_eos.
2. `all_schedulers`: every scheduler up; concurrency 64 per scheduler. `scaling` = its output
   tok/s over phase 1's (goal >= 1.9 for two), and how the requests spread over the schedulers
   (load-aware placement: a scheduler without room answers claims `busy`).
3. `one_stops_mid_run`: the same load; after `--stop-after-s` the last scheduler gets SIGTERM (it
   drains: takes no new claims, finishes what it holds for up to 8 s, fails the rest clearly);
   the run's completed / failed counts and error texts, then a short run on what is left.
4. With `--draft-model`: phases 1 and 2 again with `--speculative-algorithm dspark` (the draft
   config must fit the target shape, e.g. --model-config ops/model_configs/Qwen3-8B
   --draft-model ops/model_configs/Qwen3-8B-dspark).

NCCL and NVLink settings are not touched: nothing here uses them (the schedulers are separate
processes that share nothing but NATS). On the two-GPU machine:

    sparkwire bench two-gpu-serve --out ops/bench/results/two_gpu_serve.json
A CPU rehearsal of the same path (tiny numbers, no GPU):

    sparkwire bench two-gpu-serve --device cpu --model-config ops/models/sparkwire-micro \\
        --concurrency 4 --prompts-per-scheduler 8 --input-len 16 --output-len 16 --num-warmups 1 --out /tmp/two.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ops.bench.common import MODEL_CONFIGS, RESULTS, script
from ops.bench.gpu_serve_check import serving_model_dir
from ops.bench.serve import ServeConfig, run_serve_benchmark
from ops.bench.serve_launch import LoggedProcess, health_ok
from services.common.nats_server import NatsServer, free_port, start_nats_server

READY_TIMEOUT_S = 600.0
STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class TwoGpuConfig:
    model_config: Path = MODEL_CONFIGS / "Qwen3-1.7B"
    draft_model: Path | None = None
    device: str = "cuda"
    num_schedulers: int = 2
    concurrency: int = 64  # per scheduler
    prompts_per_scheduler: int = 320
    input_len: int = 128
    output_len: int = 128
    num_warmups: int = 16
    stop_after_s: float = 5.0
    progress: bool = True


@dataclass
class Fleet:
    """The processes of one run; schedulers come and go between phases."""

    config: TwoGpuConfig
    model_dir: Path
    log_dir: Path
    nats: NatsServer
    port: int = field(default_factory=free_port)
    processes: dict[str, LoggedProcess] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> LoggedProcess:
        argv = [sys.executable, "-m", "services.cli", *args, "--nats-url", self.nats.url, "--model", str(self.model_dir)]
        # Appended: a scheduler restarted for the next phase keeps one log.
        self.processes[name] = LoggedProcess.start(name, argv, self.log_dir / f"{name}.log", env, append=True)
        return self.processes[name]

    def start_front(self) -> None:
        self.start("detokenizer", ["detokenizer"])
        self.start("tokenizer", ["tokenizer", "--port", str(self.port)])

    def start_scheduler(self, index: int, dspark: bool) -> LoggedProcess:
        args = ["scheduler", "--device", self.config.device, "--load-format", "dummy",
                "--max-running-requests", str(self.config.concurrency)]  # fmt: skip
        if dspark:
            args += ["--speculative-algorithm", "dspark", "--draft-model", str(self.config.draft_model)]
        env = {"CUDA_VISIBLE_DEVICES": str(index)} if self.config.device == "cuda" else {}
        process = self.start(f"scheduler-{index}", args, env)
        process.wait_until(lambda: "scheduler.ready" in process.log(), READY_TIMEOUT_S, f"{process.name} not ready")
        return process

    def wait_healthy(self) -> None:
        """Until /health is 200: the tokenizer sees a scheduler and the detokenizer."""
        self.processes["tokenizer"].wait_until(lambda: health_ok(self.base_url), READY_TIMEOUT_S, f"{self.base_url}/health not 200")

    def stop(self, name: str) -> None:
        self.processes.pop(name).stop(STOP_GRACE_S)

    def schedulers(self) -> list[LoggedProcess]:
        return [process for name, process in self.processes.items() if name.startswith("scheduler-")]

    def close(self) -> None:
        for name in list(self.processes):
            self.stop(name)
        self.nats.stop()


def serve_config(fleet: Fleet, num_schedulers: int, num_warmups: int | None = None) -> ServeConfig:
    config = fleet.config
    return ServeConfig(
        base_url=fleet.base_url, num_prompts=config.prompts_per_scheduler * num_schedulers, input_len=config.input_len,
        output_len=config.output_len, ignore_eos=True, max_concurrency=config.concurrency * num_schedulers,
        num_warmups=config.num_warmups if num_warmups is None else num_warmups, vocab_from=fleet.model_dir,
        progress=config.progress,
    )  # fmt: skip


def measured(fleet: Fleet, serve: ServeConfig) -> dict[str, Any]:
    """One benchmark run, with how many requests each scheduler took during it."""
    before = {process.name: process.log().count("scheduler.request_added") for process in fleet.schedulers()}
    result = run_serve_benchmark(serve)
    taken = {process.name: process.log().count("scheduler.request_added") - before[process.name] for process in fleet.schedulers()}
    return {**result, "requests_per_scheduler": taken}


def stop_mid_run(fleet: Fleet) -> dict[str, Any]:
    """The full load, and SIGTERM to the last scheduler `stop_after_s` into it."""
    holder: dict[str, Any] = {}
    serve = serve_config(fleet, len(fleet.schedulers()), num_warmups=0)
    running = threading.Thread(target=lambda: holder.update(result=measured(fleet, serve)))
    running.start()
    time.sleep(fleet.config.stop_after_s)
    leaving = fleet.schedulers()[-1]
    leaving.process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    leaving.process.wait(timeout=STOP_GRACE_S)
    running.join()
    fleet.processes.pop(leaving.name)
    after = run_serve_benchmark(serve_config(fleet, len(fleet.schedulers()), num_warmups=0))
    return {"during": holder["result"], "stopped": leaving.name, "exit_code": leaving.process.returncode,
            "exit_s": time.monotonic() - started, "after": after}  # fmt: skip


def run_phases(fleet: Fleet, dspark: bool) -> dict[str, Any]:
    prefix = "dspark_" if dspark else ""
    phases: dict[str, Any] = {}
    fleet.start_scheduler(0, dspark)
    fleet.wait_healthy()
    phases[f"{prefix}one_scheduler"] = measured(fleet, serve_config(fleet, 1))
    for index in range(1, fleet.config.num_schedulers):
        fleet.start_scheduler(index, dspark)
    phases[f"{prefix}all_schedulers"] = measured(fleet, serve_config(fleet, fleet.config.num_schedulers))
    one, every = phases[f"{prefix}one_scheduler"], phases[f"{prefix}all_schedulers"]
    phases[f"{prefix}scaling"] = every["output_throughput"] / one["output_throughput"] if one["output_throughput"] else None
    if not dspark:
        phases["one_stops_mid_run"] = stop_mid_run(fleet)
    for process in fleet.schedulers():
        fleet.stop(process.name)
    return phases


def run(config: TwoGpuConfig, out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()}}
    with tempfile.TemporaryDirectory(prefix="sparkwire-two-gpu-") as tmp:
        log_dir = out.parent / "two_gpu_serve_logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        fleet = Fleet(config, serving_model_dir(config.model_config, Path(tmp) / "model"), log_dir, start_nats_server())
        try:
            fleet.start_front()
            for dspark in (False, True) if config.draft_model else (False,):
                result.update(run_phases(fleet, dspark))
        except Exception:
            result["error"] = traceback.format_exc()[-4000:]
        finally:
            fleet.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(summary(result))
    return result


def summary(result: dict[str, Any]) -> str:
    lines = ["| phase | ok / failed | output tok/s | requests per scheduler (warmups included) |", "|---|---|---|---|"]
    for name, phase in result.items():
        if isinstance(phase, dict) and "output_throughput" in phase:
            lines.append(f"| {name} | {phase['completed']} / {phase['failed']} | {phase['output_throughput']:.0f} | "
                         f"{phase['requests_per_scheduler']} |")  # fmt: skip
    for name in ("scaling", "dspark_scaling"):
        if result.get(name) is not None:
            lines.append(f"\n{name}: {result[name]:.2f}x (goal >= 1.9x for two schedulers)")
    stopping = result.get("one_stops_mid_run")
    if stopping:
        during, after = stopping["during"], stopping["after"]
        lines.append(f"\n{stopping['stopped']} stopped mid-run (exit {stopping['exit_code']} after {stopping['exit_s']:.1f}s): "
                     f"{during['completed']} completed, {during['failed']} failed; afterwards {after['completed']} / "
                     f"{after['failed']}")  # fmt: skip
    if "error" in result:
        lines.append(f"\nerror: {result['error'].splitlines()[-1]}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TwoGpuConfig()
    parser.add_argument("--model-config", type=Path, default=defaults.model_config)
    parser.add_argument("--draft-model", type=Path, default=None, help="a DSpark draft config fitting the target: adds the dspark phases")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=defaults.device)
    parser.add_argument("--num-schedulers", type=int, default=defaults.num_schedulers)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="per scheduler")
    parser.add_argument("--prompts-per-scheduler", type=int, default=defaults.prompts_per_scheduler)
    parser.add_argument("--input-len", type=int, default=defaults.input_len)
    parser.add_argument("--output-len", type=int, default=defaults.output_len)
    parser.add_argument("--num-warmups", type=int, default=defaults.num_warmups)
    parser.add_argument("--stop-after-s", type=float, default=defaults.stop_after_s)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "two_gpu_serve.json")


def main(args: argparse.Namespace) -> int:
    config = TwoGpuConfig(
        model_config=args.model_config, draft_model=args.draft_model, device=args.device, num_schedulers=args.num_schedulers,
        concurrency=args.concurrency, prompts_per_scheduler=args.prompts_per_scheduler, input_len=args.input_len,
        output_len=args.output_len, num_warmups=args.num_warmups, stop_after_s=args.stop_after_s, progress=not args.no_progress,
    )  # fmt: skip
    return 1 if "error" in run(config, args.out) else 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
