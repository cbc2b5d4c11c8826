"""Where a decode step's time goes on the device, plain against DSpark (issue 46 point 2).

At batch 1 on the 8B shape DSpark's step costs ~4.2 ms over plain's ~5.7 (results/gpu_core.md),
where a verify of gamma + 1 tokens and a 5-layer drafter should cost about a millisecond more than
a decode step; the trained 47M pair's DSpark step costs 5.5 of its plain steps. This profiles held
decode steps of each core with `torch.profiler`, the cores built as `gpu-core` builds them (decode
graphs, draft graphs, fused kernels; DSpark `static` at a SIMULATED accept length, so every step
does the same work), and reports per mode:

- wall ms a step (the profiled steps' wall time over their number: the profiler's own cost included,
  the same for both modes);
- device-busy ms a step: the union of the step's kernels' intervals (what the GPU computed);
- idle ms a step: wall less busy (launch gaps between graphs and kernels, host work, waits);
- kernels a step, and the kernels with the most device time (name, count a step, ms a step).

CPU (`--tiny --device cpu`, the smoke run): the same table from the top-level CPU ops instead of
kernels (no GPU figure).

    sparkwire bench dspark-step-profile --out $OUT/dspark_step_profile.json               # 8B shape, CUDA
    sparkwire bench dspark-step-profile --tiny --device cpu --out /tmp/dspark_step_profile.json
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from contracts.scheduler import LogprobParams
from ops.bench import scheduler_harness as harness
from ops.bench.common import MODEL_CONFIGS, bench_dtype, device_name, script, synchronize, write_json
from ops.bench.gpu_core_check import requests, time_core
from services.scheduler.model.loader import load_model_runner

TOP_KERNELS = 15
WARM_STEPS = 4  # after the prefill: captures and first launches stay out of the profile


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def device_events(events, on_cuda: bool) -> list:
    """The profiled work: CUDA kernels (graph replays' included), or on the CPU the top-level aten ops."""
    if on_cuda:
        return [e for e in events if e.device_type == DeviceType.CUDA]
    return [e for e in events if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]


def profile_steps(core, batch: int, prompt_len: int, steps: int, vocab: int, device: str) -> dict:
    """`steps` decode steps of `batch` requests under the profiler, after the prefill and WARM_STEPS."""
    for request in requests(batch, prompt_len, WARM_STEPS + steps + 64, vocab, LogprobParams(), "p"):
        core.add(request)
    for _ in range(1 + WARM_STEPS):
        core.step()
    synchronize(device)
    on_cuda = device == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            core.step()
        synchronize(device)
        wall_s = time.perf_counter() - began
    while core.has_work():  # the rest of the requests, so the next core starts empty
        core.step()
    work = device_events(prof.events(), on_cuda)
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for event in work:
        by_name[event.name].append(event.time_range.end - event.time_range.start)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in work]) / 1e3 / steps
    return {
        "steps": steps, "wall_ms": wall_s * 1e3 / steps, "busy_ms": busy, "idle_ms": wall_s * 1e3 / steps - busy,
        "kernels": len(work) / steps,
        "top": [{"name": name[:120], "per_step": len(times) / steps, "ms": sum(times) / 1e3 / steps} for name, times in top],
    }  # fmt: skip


def measure(args: argparse.Namespace) -> int:
    runner = load_model_runner(args.target, device=args.device, dtype=bench_dtype(args.device), load_format="dummy", cuda_graphs=False)
    if runner.decode_kernel:
        runner.prepare_decode_graphs(query_lens=(1,))
    proposer = harness.dspark_proposer(runner, args.draft, confidences=False)  # static verify: no confidences
    vocab = runner.config.vocab_size
    result = {"device": device_name(args.device), "torch": torch.__version__, "batch": args.batch, "unit": "kernels" if args.device == "cuda" else "ops",
              "simulated_accept_len": args.simulate_accept_len, "gamma": proposer.num_draft_tokens, "modes": {}}  # fmt: skip
    for mode in ("plain", "dspark"):
        spec = {"proposer": proposer, "simulated_accept_len": args.simulate_accept_len} if mode == "dspark" else {}
        core = harness.core_for(runner, max_running_requests=args.batch, chunked_prefill_size=16384, **spec)
        # warm-up as long as a timed run: draft graphs are captured on first use per context bucket
        time_core(core, requests(args.batch, args.prompt_len, args.steps + 64, vocab, LogprobParams(), "w"))
        result["modes"][mode] = profile_steps(core, args.batch, args.prompt_len, args.steps, vocab, args.device)
    write_json(args.out, result)
    print(table(result))
    return 0


def table(result: dict) -> str:
    unit = result["unit"]
    lines = [f"{result['device']}, batch {result['batch']}, DSpark static gamma {result['gamma']} at a SIMULATED accept length "
             f"{result['simulated_accept_len']}",
             f"| mode | wall ms a step | busy ms | idle ms | {unit} a step |", "|---|---|---|---|---|"]  # fmt: skip
    for mode, row in result["modes"].items():
        lines.append(f"| {mode} | {row['wall_ms']:.3f} | {row['busy_ms']:.3f} | {row['idle_ms']:.3f} | {row['kernels']:.1f} |")
    for mode, row in result["modes"].items():
        lines.append(f"\n{mode}: the {unit} with the most time (count a step, ms a step)")
        lines += [f"  {k['ms']:8.3f} ms  {k['per_step']:6.1f}x  {k['name']}" for k in row["top"]]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, default=MODEL_CONFIGS / "Qwen3-8B", help="target config directory (dummy weights)")
    parser.add_argument("--draft", type=Path, default=MODEL_CONFIGS / "Qwen3-8B-dspark", help="DSpark draft config (dummy weights)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random target and a one-layer dummy drafter (smoke)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for the smoke run")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="decode steps profiled per mode")
    parser.add_argument("--simulate-accept-len", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)


def main(args: argparse.Namespace) -> int:
    return harness.on_tiny_pair(args, measure) if args.tiny else measure(args)


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
