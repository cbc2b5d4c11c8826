"""Issue 12: the time the scheduler's device waits between steps, through the whole stack.

One nats-server, one tokenizer and one detokenizer (this checkout), and for each decode loop
compared a scheduler process of its own, started from a checkout of that loop's commit
(`--baseline-rev`: a temporary `git worktree`; `current`: this checkout) through
`timed_scheduler.py`, which times every `core.step` from outside. For each concurrency, each loop
serves the same `sparkwire bench serve` load (all requests at once, ignore_eos). Per run:

- `gap_ms`: from the end of one step to the start of the next, over the steps that ended with work
  left (the device's idle time that the decode loop adds: a loop round trip, publishing);
- `step_ms`: the steps themselves; `busy`: step time over step + gap time;
- the serving figures (output tok/s, TPOT) of `bench serve`.

On the CPU the forward dominates, so the gap tells more than tok/s; `scheduler_cpu_ms_per_token`
shows what the loop costs the host. For example, a branch with another decode loop (such as the
`stepthread` branch of 2026-12-01, which main does not contain: ops/bench/results/step_gap.md)
against main's:

    git checkout BRANCH && python -m ops.bench.step_gap --baseline-rev main --concurrency 16 64
    # on a GPU: --device cuda --model DIR (config + tokenizer) --scheduler-args="--load-format dummy"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ops.bench.serve import ServeConfig, run_serve_benchmark
from ops.bench.serve_launch import LoggedProcess, health_ok
from services.common.nats_server import free_port, start_nats_server
from services.models import RANDOM_TINY_MODEL

REPO = Path(__file__).resolve().parents[2]
TIMED_SCHEDULER = Path(__file__).resolve().parent / "timed_scheduler.py"
READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class StepGapConfig:
    baseline_rev: str | None = None  # the decode loop to compare with; None: only this checkout's
    model: Path = RANDOM_TINY_MODEL
    device: str = "cpu"
    concurrency: tuple[int, ...] = (16, 64)
    prompts_per_slot: int = 3  # requests per concurrency slot
    input_len: int = 32
    output_len: int = 128
    repeats: int = 1  # runs of each (concurrency, loop), interleaved
    scheduler_args: tuple[str, ...] = ()  # more scheduler flags, e.g. ("--load-format", "dummy") on a GPU


def gap_figures(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Step and gap statistics (ms) of one scheduler's timed steps, in the order they ran."""
    gaps = [(after["start"] - before["end"]) * 1e3 for before, after in zip(steps, steps[1:]) if before["work_left"]]
    durations = [(step["end"] - step["start"]) * 1e3 for step in steps]
    if len(gaps) < 2:
        return {"num_steps": len(steps), "num_gaps": len(gaps)}
    cuts = statistics.quantiles(gaps, n=100)
    return {
        "num_steps": len(steps), "num_gaps": len(gaps), "gap_ms_mean": statistics.fmean(gaps),
        "gap_ms_p50": cuts[49], "gap_ms_p90": cuts[89], "gap_ms_p99": cuts[98], "step_ms_mean": statistics.fmean(durations),
        "busy": sum(durations) / (sum(durations) + sum(gaps)),
    }  # fmt: skip


@contextlib.contextmanager
def checkout_of(rev: str) -> Iterator[Path]:
    """A detached `git worktree` of `rev`, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="sparkwire-step-gap-") as tmp:
        path = Path(tmp) / "checkout"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True, capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=True)


class Stack:
    """The front (tokenizer, detokenizer) and one scheduler at a time, over one nats-server."""

    def __init__(self, config: StepGapConfig, log_dir: Path) -> None:
        self.config, self.log_dir = config, log_dir
        self.nats = start_nats_server()
        self.port = free_port()
        self.front = [self._start(kind, [sys.executable, "-m", "services.cli", kind, *self._flags(kind)]) for kind in ("detokenizer", "tokenizer")]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _flags(self, kind: str) -> list[str]:
        flags = ["--nats-url", self.nats.url, "--model", str(self.config.model)]
        return flags + ["--port", str(self.port)] if kind == "tokenizer" else flags

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> LoggedProcess:
        return LoggedProcess.start(name, argv, self.log_dir / f"{name}.log", env, append=True)

    def serve(self, loop: str, checkout: Path, concurrency: int, step_times: Path) -> dict[str, Any]:
        """One scheduler from `checkout`, one `bench serve` run against it, its step times."""
        flags = [*self._flags("scheduler"), "--device", self.config.device, "--max-running-requests", str(concurrency),
                 *self.config.scheduler_args]  # fmt: skip
        argv = [sys.executable, str(TIMED_SCHEDULER), "--step-times", str(step_times), *flags]
        scheduler = self._start(f"scheduler-{loop}", argv, {"PYTHONPATH": str(checkout)})
        try:  # ready, and seen by the tokenizer (the previous scheduler's sentinel may still be on its way)
            scheduler.wait_until(lambda: "scheduler.ready" in scheduler.log(), READY_TIMEOUT_S, f"{scheduler.name} not ready")
            scheduler.wait_until(lambda: health_ok(self.base_url), READY_TIMEOUT_S, f"{self.base_url}/health not 200")
            serving = run_serve_benchmark(self._serve_config(concurrency))
        finally:
            scheduler.stop(STOP_GRACE_S)
        timed = json.loads(step_times.read_text())
        serving.pop("requests")
        cpu_ms_per_token = timed["cpu_s"] * 1e3 / max(1, serving["total_output_tokens"])  # start-up included
        return {"loop": loop, "services": timed["services"], "concurrency": concurrency, **gap_figures(timed["steps"]),
                "scheduler_cpu_s": timed["cpu_s"], "scheduler_cpu_ms_per_token": cpu_ms_per_token, "serve": serving}  # fmt: skip

    def _serve_config(self, concurrency: int) -> ServeConfig:
        config = self.config
        return ServeConfig(
            base_url=self.base_url, num_prompts=config.prompts_per_slot * concurrency, input_len=config.input_len,
            output_len=config.output_len, ignore_eos=True, max_concurrency=concurrency, vocab_from=config.model,
            progress=False,
        )  # fmt: skip

    def close(self) -> None:
        for process in self.front:
            process.stop(STOP_GRACE_S)
        self.nats.stop()


def run(config: StepGapConfig, out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()}, "runs": []}
    log_dir = out.parent / "step_gap_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as owned:
        loops = {"current": REPO}
        if config.baseline_rev is not None:
            loops = {"baseline": owned.enter_context(checkout_of(config.baseline_rev)), **loops}
        stack = Stack(config, log_dir)
        owned.callback(stack.close)
        try:
            for concurrency in config.concurrency:
                for repeat in range(config.repeats):
                    for loop, checkout in loops.items():
                        step_times = log_dir / f"steps-{loop}-c{concurrency}-{repeat}.json"
                        result["runs"].append(stack.serve(loop, checkout, concurrency, step_times))
        except Exception:
            result["error"] = traceback.format_exc()[-4000:]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    return result


def summary(result: dict[str, Any]) -> str:
    lines = ["| loop | concurrency | steps | gap ms mean / p50 / p90 / p99 | step ms | busy | ok / failed | output tok/s | TPOT ms |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in result["runs"]:
        serve = run["serve"]
        gaps = "/".join(f"{run.get(f'gap_ms_{k}', float('nan')):.3f}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"| {run['loop']} | {run['concurrency']} | {run['num_steps']} | {gaps} | {run.get('step_ms_mean', float('nan')):.2f} "
                     f"| {run.get('busy', float('nan')):.3f} | {serve['completed']} / {serve['failed']} | {serve['output_throughput']:.0f} | {serve['tpot_ms']['mean']:.2f} |")  # fmt: skip
    if "error" in result:
        lines.append(f"\nerror: {result['error'].splitlines()[-1]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = StepGapConfig()
    parser.add_argument("--baseline-rev", default=None, help="the commit whose decode loop to compare with (e.g. main before a change)")
    parser.add_argument("--model", type=Path, default=defaults.model)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=defaults.device)
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(defaults.concurrency))
    parser.add_argument("--prompts-per-slot", type=int, default=defaults.prompts_per_slot)
    parser.add_argument("--input-len", type=int, default=defaults.input_len)
    parser.add_argument("--output-len", type=int, default=defaults.output_len)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--scheduler-args", default="", help='more scheduler flags, e.g. --scheduler-args="--load-format dummy"')
    parser.add_argument("--out", type=Path, default=REPO / "ops/bench/results/step_gap.json")
    args = parser.parse_args()
    config = StepGapConfig(
        baseline_rev=args.baseline_rev, model=args.model, device=args.device, concurrency=tuple(args.concurrency),
        prompts_per_slot=args.prompts_per_slot, input_len=args.input_len, output_len=args.output_len, repeats=args.repeats,
        scheduler_args=tuple(shlex.split(args.scheduler_args)),
    )  # fmt: skip
    run(config, args.out)


if __name__ == "__main__":
    main()
