"""What the front half carries without a GPU: the real detokenizer and `--tokenizers` tokenizers
(processes, one port) behind a stand-in scheduler that decodes at a GPU's pace
(`paced_scheduler.py`: one token per running request every `--step-ms`), loaded by `sparkwire
bench serve` at `--concurrency` streams of `--output-len` tokens, without and with top-k output
logprobs. The stand-in's rate (concurrency / step) is the ceiling: output tok/s under it, and TTFT
and TPOT over what the pace gives, are the front half's doing. Per scenario it also records each
process's CPU (cores) and the tokenizers' CPU per output token.

Issue 12, point 4 (top-20 output logprobs cost <= 5% of tok/s at batch 64): on a GPU the 0.6B
shape decodes 64 requests every ~2 ms, and there the front end, not the GPU, set what top-20 cost
(ops/bench/results/gpu_serve.md). This reproduces that load on a CPU box.

`--before DIR` runs that checkout's own copy of this script (e.g. a `git worktree` of the commit
before a front-end change), the two alternating for `--rounds` rounds, in one results file.

    sparkwire bench frontend-capacity --out ops/bench/results/frontend_capacity.json
    sparkwire bench frontend-capacity --before /tmp/base --rounds 2 --out ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from ops.bench.common import REPO, RESULTS, script, write_json
from ops.bench.logprob_transport import ProcessMeter
from ops.bench.serve import ServeConfig, benchmark
from ops.bench.serve_launch import health_ok
from services.common.nats_server import free_port, start_nats_server
from services.models import BUNDLED_MODEL

PACED = Path(__file__).resolve().parent / "paced_scheduler.py"
SCENARIOS = {"plain": None, "top20": 20}
READY_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Load:
    concurrency: int = 64
    step_ms: float = 2.0
    num_prompts: int = 1024
    input_len: int = 128
    output_len: int = 128
    tokenizers: int = 1

    @property
    def ceiling_tok_s(self) -> float:
        return self.concurrency * 1e3 / self.step_ms


def start_processes(nats_url: str, port: int, load: Load, logs: Path) -> dict[str, subprocess.Popen]:
    """The stand-in scheduler, the detokenizer and the tokenizers, each logging to `logs`."""
    paced = subprocess.Popen([sys.executable, str(PACED), nats_url, "--step-ms", str(load.step_ms)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    if paced.stdout is None or paced.stdout.readline().strip() != "ready":
        raise RuntimeError("the paced scheduler did not start")
    service = [sys.executable, "-m", "services.cli"]
    common = ["--nats-url", nats_url, "--model", str(BUNDLED_MODEL), "--log-level", "warning"]
    processes = {"paced scheduler": paced,
                 "detokenizer": subprocess.Popen([*service, "detokenizer", *common], stdout=(logs / "detokenizer.log").open("wb"), stderr=subprocess.STDOUT)}  # fmt: skip
    for index in range(load.tokenizers):
        argv = [*service, "tokenizer", *common, "--port", str(port), *(["--reuse-port"] if load.tokenizers > 1 else [])]
        log = (logs / f"tokenizer-{index}.log").open("wb")
        processes[f"tokenizer-{index}"] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    return processes


def stop_processes(processes: dict[str, subprocess.Popen]) -> None:
    for name, process in processes.items():
        if name == "paced scheduler" and process.stdin is not None:
            process.stdin.close()
        else:
            process.terminate()
    for process in processes.values():
        process.wait(timeout=30)


def wait_ready(base_url: str, processes: dict[str, subprocess.Popen]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not health_ok(base_url):
        dead = [name for name, p in processes.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"front half not ready (exited: {dead})")
        time.sleep(0.2)


def scenario(base_url: str, load: Load, top_k: int | None, meter: ProcessMeter) -> dict[str, Any]:
    config = ServeConfig(base_url=base_url, num_prompts=load.num_prompts, input_len=load.input_len, output_len=load.output_len,
                         max_concurrency=load.concurrency, ignore_eos=True, logprobs=top_k, num_warmups=load.concurrency,
                         vocab_from=BUNDLED_MODEL, progress=False)  # fmt: skip
    before, began = meter.read(), time.monotonic()
    result = uvloop.run(benchmark(config))
    seconds, cpu = time.monotonic() - began, ProcessMeter.per_run(before, meter.read(), 1)
    cores = {name: round(figures["cpu_ms"] / 1e3 / seconds, 3) for name, figures in cpu.items()}
    tokenizer_cpu_s = sum(figures["cpu_ms"] for name, figures in cpu.items() if name.startswith("tokenizer")) / 1e3
    tokens = (load.num_prompts + load.concurrency) * load.output_len  # the warm-ups' too: ignore_eos, every request that long
    return {
        "output_tok_s": round(result["output_throughput"], 1),
        "of_ceiling": round(result["output_throughput"] / load.ceiling_tok_s, 3),
        "failed": result["failed"],
        **{f"{name}_p50": round(result[f"{name}_ms"]["p50"], 2) for name in ("ttft", "itl", "tpot")},
        "ttft_p99": round(result["ttft_ms"]["p99"], 2),
        "client_cpu_fraction": round(result["client_cpu_fraction"], 3),
        "cores": cores,
        "tokenizer_us_per_token": round(tokenizer_cpu_s * 1e6 / tokens, 2),
    }


def run(load: Load) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sparkwire-frontend-") as directory:
        server, port = start_nats_server(), free_port()
        base_url = f"http://127.0.0.1:{port}"
        processes = start_processes(server.url, port, load, Path(directory))
        try:
            wait_ready(base_url, processes)
            meter = ProcessMeter({name: p.pid for name, p in processes.items()} | {"nats-server": server.process.pid})
            scenarios = {name: scenario(base_url, load, top_k, meter) for name, top_k in SCENARIOS.items()}
        finally:
            stop_processes(processes)
            server.stop()
    plain, top = scenarios["plain"]["output_tok_s"], scenarios["top20"]["output_tok_s"]
    return {"load": dataclasses.asdict(load) | {"ceiling_tok_s": load.ceiling_tok_s}, "scenarios": scenarios,
            "top20_cost": round(1 - top / plain, 4) if plain else None, "services": str(Path(sys.modules["services"].__file__).parent)}  # fmt: skip


def compare(before: Path, argv: list[str], rounds: int) -> dict[str, list]:
    """This tree and `before` alternately, `rounds` times each."""
    from ops.bench.other_tree import alternate  # the parent's only: the child imports from the other tree

    return alternate(__file__, {"after": REPO, "before": before}, argv, rounds)


def table(runs: dict[str, list]) -> str:
    lines = ["| tree | tokenizers | scenario | output tok/s | of ceiling | TTFT p50 / p99 ms | TPOT p50 ms | tokenizers' cores | "
             "tokenizer us/token | detokenizer cores | client CPU | top-20 cost |", "|---" * 12 + "|"]  # fmt: skip
    for tree, results in runs.items():
        for result in results:
            for name, s in result["scenarios"].items():
                tok_cores = sum(v for k, v in s["cores"].items() if k.startswith("tokenizer"))
                cost = f"{result['top20_cost']:.1%}" if name == "top20" and result["top20_cost"] is not None else ""
                lines.append(f"| {tree} | {result['load']['tokenizers']} | {name} | {s['output_tok_s']:.0f} | {s['of_ceiling']:.3f} | "
                             f"{s['ttft_p50']:.1f} / {s['ttft_p99']:.1f} | {s['tpot_p50']:.2f} | {tok_cores:.2f} | "
                             f"{s['tokenizer_us_per_token']:.1f} | {s['cores'].get('detokenizer', 0):.2f} | {s['client_cpu_fraction']:.2f} | {cost} |")  # fmt: skip
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=Load.concurrency)
    parser.add_argument("--step-ms", type=float, default=Load.step_ms, help="the stand-in's decode step")
    parser.add_argument("--num-prompts", type=int, default=Load.num_prompts)
    parser.add_argument("--output-len", type=int, default=Load.output_len)
    parser.add_argument("--tokenizers", type=int, default=Load.tokenizers)
    parser.add_argument("--before", type=Path, default=None, help="another checkout, run alternately with this one")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--print-json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "frontend_capacity.json")


def main(args: argparse.Namespace) -> int:
    load = Load(args.concurrency, args.step_ms, args.num_prompts, output_len=args.output_len, tokenizers=args.tokenizers)
    if args.print_json:
        print(json.dumps(run(load)))
        return 0
    if args.before is not None:
        argv = [f"--concurrency={load.concurrency}", f"--step-ms={load.step_ms}", f"--num-prompts={load.num_prompts}",
                f"--output-len={load.output_len}", f"--tokenizers={load.tokenizers}"]  # fmt: skip
        runs = compare(args.before, argv, args.rounds)
    else:
        runs = {"this tree": [run(load) for _ in range(args.rounds)]}
    write_json(args.out, {"runs": runs, "cpus": os.cpu_count()})
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
