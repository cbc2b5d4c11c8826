"""Where a decode step's time goes through `SchedulerCore`, overlapped decoding off against on:
one request (or --batch), dummy weights, the step loop under `torch.profiler` (CPU and CUDA).

Per setting: ms per step (host clock, unprofiled run first), the device's kernel time per step, and
the CUDA runtime calls the host makes (launches, copies, synchronizes, host allocations), with their
count and total ms; then the ops with the most host self time.

    PYTHONPATH=. python ops/bench/gpu_step_profile.py --model ops/model_configs/Qwen3-0.6B --out $OUT/gpu_step_profile.json
    PYTHONPATH=. python ops/bench/gpu_step_profile.py --device cpu --out /tmp/profile.json  # smoke (tiny model)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from contracts.scheduler import LogprobParams, SamplingParams
from services.models import RANDOM_TINY_MODEL
from services.scheduler.core import SchedulerCore
from services.scheduler.model.loader import load_model_runner
from services.scheduler.request import SchedulerRequest

REPO = Path(__file__).resolve().parents[2]
LOGPROBS = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=5)
HOST_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaHostAlloc", "cudaFreeHost",
         "cudaMemcpyAsync", "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaEventQuery", "cudaLaunchKernel",
         "cudaGraphLaunch")  # fmt: skip


def steps(core: SchedulerCore, batch: int, new_tokens: int, logprobs: LogprobParams, vocab: int) -> int:
    prompts = np.random.default_rng(0).integers(0, vocab, size=(batch, 128), dtype=np.int32)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add(SchedulerRequest(f"r{index}", prompt, "d", sampling, logprobs))
    count = 0
    while core.has_work():
        core.step()
        count += 1
    return count


def measure(runner, overlap: bool, batch: int, new_tokens: int, logprobs: LogprobParams, cuda: bool) -> dict:
    make = lambda: SchedulerCore(runner, max_running_requests=max(batch, 1), chunked_prefill_size=8192, overlap_decode=overlap)  # noqa: E731
    vocab = runner.config.vocab_size
    steps(make(), batch, 4, logprobs, vocab)  # warm-up at these shapes
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    begin = time.perf_counter()
    count = steps(make(), batch, new_tokens, logprobs, vocab)
    sync()
    ms_per_step = 1e3 * (time.perf_counter() - begin) / count
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        count = steps(make(), batch, new_tokens, logprobs, vocab)
        sync()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.self_device_time_total and not e.key.startswith("cuda"))
    host_calls = {e.key: {"count": e.count, "ms": round(e.cpu_time_total / 1e3, 2)} for e in events if e.key in HOST_CALLS}
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "overlap": overlap, "ms_per_step": round(ms_per_step, 3), "steps": count,
        "device_ms_per_step": round(device_us / 1e3 / count, 3), "host_calls": host_calls,
        "top_host_self_ms": {e.key: round(e.self_cpu_time_total / 1e3, 2) for e in top},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "ops/model_configs/Qwen3-0.6B", help="config directory (dummy weights)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the tiny model (smoke)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "ops/bench/results/gpu_step_profile.json")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    model = args.model if cuda else RANDOM_TINY_MODEL
    dtype = torch.bfloat16 if cuda else torch.float32
    runner = load_model_runner(model, device=args.device, dtype=dtype, load_format="dummy")
    rows = []
    for logprobs in (LogprobParams(), LOGPROBS):
        for overlap in (False, True):
            row = measure(runner, overlap, args.batch, args.new_tokens if cuda else 8, logprobs, cuda)
            rows.append({"logprobs": logprobs.return_logprob, **row})
    result = {"model": str(model), "batch": args.batch, "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for r in rows:
        print(f"logprobs={r['logprobs']} overlap={r['overlap']}: {r['ms_per_step']} ms/step, device {r['device_ms_per_step']} ms/step")
        print("   host calls:", {k: v for k, v in r["host_calls"].items()})
        print("   host self ms:", r["top_host_self_ms"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
