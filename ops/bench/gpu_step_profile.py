"""Where a decode step's time goes through `SchedulerCore`, built as the stack builds it
(`service.build_core`: graphs, fused kernels and logprob kernels as `sparkwire up` sets them up), with
and without top-k output logprobs, overlapped decoding off against on (or, with --draft, DSpark
with that dummy drafter, which never overlaps): one request (or --batch), dummy weights, the step
loop under `torch.profiler` (CPU and CUDA), then under cProfile.

Per setting: ms per step (host clock, unprofiled run first: `ms_per_step` is the whole run over
all its steps, the batch's prefill step included, so above a decode step's at large batches;
`decode_ms_per_step` the median decode step's wall, what `host_ms_per_step` compares with), the device's kernel time per
step (also over all steps, the prefill's kernels included), and
the CUDA runtime calls the host makes (launches, copies, synchronizes, host allocations), with their
count and total ms; the ops with the most host self time; the Python functions with the most
self time per step (cProfile: where host time goes that no torch op accounts for).

    PYTHONPATH=. python ops/bench/gpu_step_profile.py --model ops/model_configs/Qwen3-0.6B --out $OUT/gpu_step_profile.json
    PYTHONPATH=. python ops/bench/gpu_step_profile.py --model ops/model_configs/Qwen3-8B --draft ops/model_configs/Qwen3-8B-dspark \
        --batch 64 --top-logprobs 20 --out $OUT/gpu_step_profile_dspark.json
    PYTHONPATH=. python ops/bench/gpu_step_profile.py --device cpu --out /tmp/profile.json  # smoke (tiny model)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from contracts.scheduler import LogprobParams, SamplingParams
from services.models import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL, RANDOM_TINY_MODEL
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.request import SchedulerRequest
from services.scheduler.build import build_core

REPO = Path(__file__).resolve().parents[2]
HOST_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaHostAlloc", "cudaFreeHost",
         "cudaMemcpyAsync", "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaEventQuery", "cudaLaunchKernel",
         "cudaGraphLaunch")  # fmt: skip


def steps(core: SchedulerCore, batch: int, new_tokens: int, logprobs: LogprobParams, vocab: int) -> tuple[int, list[float], list[float]]:
    """(steps run, each decode step's host seconds: its `core.step` wall time less its wait for the
    device's readback, `StepRecord.collect_s`; with overlap, what the host must do per step; each
    decode step's wall seconds)."""
    prompts = np.random.default_rng(0).integers(0, vocab, size=(batch, 128), dtype=np.int32)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add(SchedulerRequest(f"r{index}", prompt, "d", sampling, logprobs))
    count, hosts, walls = 0, [], []
    while core.has_work():
        begin = time.perf_counter()
        core.step()
        wall = time.perf_counter() - begin
        count += 1
        record = core.last_step
        if record is not None and record.num_prefill_tokens == 0:
            hosts.append(wall - record.collect_s)
            walls.append(wall)
    return count, hosts, walls


def measure(core: SchedulerCore, overlap: bool, batch: int, new_tokens: int, logprobs: LogprobParams, cuda: bool) -> dict:
    core.overlap_decode = overlap
    vocab = core.vocab_size
    steps(core, batch, 4, logprobs, vocab)  # warm-up at these shapes (graphs captured on first use)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    begin = time.perf_counter()
    count, hosts, walls = steps(core, batch, new_tokens, logprobs, vocab)
    sync()
    ms_per_step = 1e3 * (time.perf_counter() - begin) / count  # the whole run over its steps: the prefill's included
    host_ms = round(1e3 * float(np.median(hosts)), 4)
    decode_ms = round(1e3 * float(np.median(walls)), 4)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        count, _, _ = steps(core, batch, new_tokens, logprobs, vocab)
        sync()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.self_device_time_total and not e.key.startswith("cuda"))
    host_calls = {e.key: {"count": e.count, "ms": round(e.cpu_time_total / 1e3, 2)} for e in events if e.key in HOST_CALLS}
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "overlap": overlap, "ms_per_step": round(ms_per_step, 3), "decode_ms_per_step": decode_ms, "host_ms_per_step": host_ms, "steps": count,
        "device_ms_per_step": round(device_us / 1e3 / count, 3), "host_calls": host_calls,
        "top_host_self_ms": {e.key: round(e.self_cpu_time_total / 1e3, 2) for e in top},
        "python_self_ms_per_step": python_profile(core, batch, new_tokens, logprobs, sync),
    }  # fmt: skip


def python_profile(core: SchedulerCore, batch: int, new_tokens: int, logprobs: LogprobParams, sync, top: int = 15) -> dict[str, float]:
    """The step loop once more under cProfile: the functions with the most self time, ms per step."""
    profiler = cProfile.Profile()
    profiler.enable()
    count, _, _ = steps(core, batch, new_tokens, logprobs, core.vocab_size)
    sync()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, self s, cumulative s, callers)
    ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return {f"{Path(file).name}:{line}({name})": round(1e3 * entry[2] / count, 3) for (file, line, name), entry in ranked}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "ops/model_configs/Qwen3-0.6B", help="config directory (dummy weights)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the tiny model (smoke)")
    parser.add_argument("--draft", type=Path, default=None, help="DSpark with this drafter's config (dummy weights); on cpu the bundled pair")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--top-logprobs", type=int, default=5, help="top-k output logprobs of the logprob rows")
    parser.add_argument("--out", type=Path, default=REPO / "ops/bench/results/gpu_step_profile.json")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    # on the CPU: the tiny model, or with --draft the bundled pair (a drafter fits its own target only)
    model = args.model if cuda else RANDOM_TINY_MODEL if args.draft is None else BUNDLED_MODEL
    draft = None if args.draft is None else args.draft if cuda else BUNDLED_DRAFT_MODEL
    config = SchedulerConfig(model=str(model), device=args.device, load_format="dummy", max_running_requests=max(args.batch, 1),
                             speculative_algorithm="none" if draft is None else "dspark", draft_model=None if draft is None else str(draft))  # fmt: skip
    core = build_core(config)
    logprobs = LogprobParams(return_logprob=True, top_logprobs_num=args.top_logprobs)
    rows = []
    for wanted in (LogprobParams(), logprobs):
        for overlap in (False,) if draft is not None else (False, True):  # a drafter never overlaps
            row = measure(core, overlap, args.batch, args.new_tokens if cuda else 8, wanted, cuda)
            rows.append({"logprobs": wanted.return_logprob, **row})
    result = {"model": str(model), "draft": None if draft is None else str(draft), "batch": args.batch, "top_logprobs": args.top_logprobs,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for r in rows:
        print(f"logprobs={r['logprobs']} overlap={r['overlap']}: {r['ms_per_step']} ms/step (decode steps: {r['decode_ms_per_step']}), "
              f"host {r['host_ms_per_step']} ms/step, device {r['device_ms_per_step']} ms/step")
        print("   host calls:", {k: v for k, v in r["host_calls"].items()})
        print("   host self ms:", r["top_host_self_ms"])
        print("   python self ms/step:", r["python_self_ms_per_step"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
