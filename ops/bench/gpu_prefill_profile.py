"""Where a long prefill's device time goes (issue 12, point 5: a 32,768-token prompt with top-2
prompt logprobs on the 8B shape in <= 1.3 s): one request through `SchedulerCore`, as
`gpu_attention_check.py --sections prefill_32k` runs it, timed unprofiled, then once under
`torch.profiler`, each kernel's device time summed into a category by its name:

- `gemm` (cuBLAS / CUTLASS / nvJet), `attention` (cuDNN, flash, the Triton varlen kernel),
  `logprobs` (the fused logprob kernels, the torch path's log-softmax and top-k), `layer_fused`
  (the fused norm / RoPE + K/V write / SiLU kernels), `copy_gather` (copies, index, gather, cat),
  `elementwise` (the rest of ATen's pointwise and reduction kernels), `other`;
- the wall time against the kernels' sum: what is left is the host and the device's idle gaps.

Settings (path, chunk budget, tokens per step while nothing decodes):
- `kernel`: the varlen kernel at the default chunk (2048, the budget before `--max-prefill-tokens`)
  and with the whole prompt in one step; `dense` (`ModelRunner.dense_prefill` from 512-token
  queries) in one step and at 8192;
- `served`: as `build_core` sets it up by default: chunks of 2048 beside decodes, and a prompt
  alone in steps of `--max-prefill-tokens` (16384; and 32768) attended on cuDNN (`--dense-prefill`);
  `served_flash4` the same with those queries on FlashAttention-4 (`flash4_attention.py`), where
  it is installed (else the rows record why not).
`seconds` is the median of --repeats timed top-2 prefills (each in `seconds_runs`: a card at its
power limit moves a 32k prefill from run to run); `clocks` what the SM clock, the board
power and the driver's throttle reasons did over them (`common.ClockSampler`, NVML). Each row
also has the peak device memory above the start, with top-2 and without (`plain_s`): the logprobs'
extra memory is the difference.

    sparkwire bench gpu-prefill --out $OUT/gpu_prefill_profile.json
    sparkwire bench gpu-prefill --device cpu --tiny --out /tmp/profile.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from contracts.scheduler import LogprobParams, SamplingParams
from ops.bench import scheduler_harness as harness
from ops.bench.common import (
    RESULTS, ClockSampler, Shape, bench_dtype, check_shape, device_name, load_runner, script, sustained_gemm, write_json,
)  # fmt: skip
from services.scheduler.model.dense_attention import DENSE_MIN_QUERY_LEN, DenseConfig
from services.scheduler.model.flash4_attention import flash4_unavailable

TOP2 = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
# (category, name fragments), first match wins; names lower-cased
CATEGORIES = (
    ("logprobs", ("_partial_lse", "_candidates_kernel", "_finish_kernel", "log_softmax", "topk", "sort")),
    ("attention", ("fmha", "flash", "cudnn", "attn", "_varlen_kernel", "sdpa", "_paged_")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm100_")),
    ("layer_fused", ("_add_rms_norm", "_rotate_and_store", "_silu_mul")),
    ("copy_gather", ("copy", "index", "gather", "cat", "memcpy", "memset", "fill")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "unrolled")),
)
# (path, chunk budget, max prefill tokens): None is the default chunk, "whole" the prompt's length
SETTINGS = (("kernel", None, None), ("kernel", "whole", None), ("dense", "whole", None), ("dense", 8192, None),
            ("served", None, harness.MAX_PREFILL_TOKENS), ("served", None, 32768),
            ("served_flash4", None, harness.MAX_PREFILL_TOKENS), ("served_flash4", None, 32768))  # fmt: skip


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((cat for cat, parts in CATEGORIES if any(p in name for p in parts)), "other")


def prefill_once(runner, chunk: int, prompt: np.ndarray, logprobs: LogprobParams, max_prefill: int | None = None) -> tuple[float, float | None]:
    """(seconds, peak device MiB above the start; None off CUDA)"""
    core = harness.core_for(runner, max_running_requests=1, chunked_prefill_size=chunk, max_prefill_tokens=max_prefill)
    core.add(harness.new_request("long", prompt, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True), logprobs))
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    while core.has_work():
        core.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return seconds, (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None


def kernel_times(prof) -> dict[str, float]:
    """kernel name -> device ms, from the profiler's device-side events."""
    times: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.time_range.elapsed_us() / 1e3
    return dict(times)


def device_gaps(prof, min_us: float = 100.0, top: int = 8) -> dict:
    """Where the device sat idle between its first and last kernel: the idle ms in all and the longest
    gaps of at least min_us, each with the kernels either side (the host's share of the wall time)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
    gaps, busy_until, last_name = [], spans[0][1] if spans else 0, spans[0][2] if spans else ""
    for start, end, name in spans[1:]:
        if start - busy_until >= min_us:
            gaps.append((start - busy_until, last_name, name))
        if end > busy_until:
            busy_until, last_name = end, name
    idle = sum(g for g, _, _ in gaps)
    longest = sorted(gaps, reverse=True)[:top]
    return {"idle_ms": round(idle / 1e3, 2), "gaps": len(gaps),
            "longest": [{"ms": round(g / 1e3, 3), "after": a[:60], "before": b[:60]} for g, a, b in longest]}  # fmt: skip


def dense_config(path: str, shape: Shape, chunk: int) -> DenseConfig | None:
    if path == "dense":
        return DenseConfig(min_query_len=min(DENSE_MIN_QUERY_LEN, shape.chunk))
    if path == "served_flash4":
        return DenseConfig(min_query_len=chunk + 1, kernel="flash4")
    return DenseConfig(min_query_len=chunk + 1) if path == "served" else None  # as build_core sets it


def profile_setting(runner, shape: Shape, path: str, chunk: int, prompt: np.ndarray, max_prefill: int | None = None,
                    repeats: int = 1) -> dict:
    runner.dense_prefill = dense_config(path, shape, chunk)
    try:
        prefill_once(runner, chunk, prompt[: 2 * min(chunk, shape.chunk)], TOP2, max_prefill)  # warm-up: kernels compiled
        prefill_once(runner, chunk, prompt, TOP2, max_prefill)  # the full shapes once: allocator grown, cuBLAS heuristics cached
        plain_s, plain_mib = prefill_once(runner, chunk, prompt, LogprobParams(), max_prefill)
        with ClockSampler() as clocks:  # the card's SM clock, power and throttle reasons over the timed runs
            timed = [prefill_once(runner, chunk, prompt, TOP2, max_prefill) for _ in range(repeats)]
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            profiled_s, _ = prefill_once(runner, chunk, prompt, TOP2, max_prefill)
    finally:
        runner.dense_prefill = None
    kernels = kernel_times(prof)
    by_category: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        by_category[category(name)] += ms
    top = sorted(kernels.items(), key=lambda item: item[1], reverse=True)[:15]
    runs = sorted(seconds for seconds, _ in timed)
    top2_mib = timed[0][1]
    memory = {"peak_extra_mib": round(top2_mib, 1), "logprobs_extra_mib": round(top2_mib - plain_mib, 1)} if top2_mib is not None else {}
    return {"path": path, "chunk": chunk, "max_prefill_tokens": max_prefill, "seconds": round(float(np.median(runs)), 4),
            "seconds_runs": [round(seconds, 4) for seconds in runs], "plain_s": round(plain_s, 4), **memory, "profiled_s": round(profiled_s, 4),
            "kernels_ms": round(sum(kernels.values()), 2), "device_idle": device_gaps(prof), "clocks": clocks.summary(), "categories_ms": {k: round(v, 2) for k, v in sorted(by_category.items())},
            "top_kernels_ms": [(name[:140], round(ms, 2)) for name, ms in top]}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    shape = check_shape(args.tiny)
    runner = load_runner(shape, args.device, bench_dtype(args.device))
    prompt = np.random.default_rng(0).integers(0, runner.config.vocab_size, shape.long_prompt, dtype=np.int32)
    rows = []
    for path, chunk, max_prefill in SETTINGS:
        if args.settings and path not in args.settings:
            continue
        size = shape.chunk if chunk is None else shape.long_prompt if chunk == "whole" else min(chunk, shape.long_prompt)
        if path == "served_flash4" and (why := flash4_unavailable(runner.device)):
            rows.append({"path": path, "chunk": size, "max_prefill_tokens": max_prefill and min(max_prefill, shape.long_prompt), "unavailable": why})
            continue
        rows.append(profile_setting(runner, shape, path, size, prompt, max_prefill and min(max_prefill, shape.long_prompt), args.repeats))
    result = {"device": device_name(args.device), "torch": torch.__version__,
              "prompt": shape.long_prompt, "model": shape.model.name, "rows": rows}  # fmt: skip
    if args.sustained_gemm_s and args.device == "cuda":
        result["sustained_gemm"] = sustained_gemm(args.sustained_gemm_s)  # the card's clock under GEMMs alone, for comparison
    write_json(args.out, result)
    print(table(result))
    if "sustained_gemm" in result:
        print(f"\nsustained GEMMs: {json.dumps(result['sustained_gemm'])}")
    return result


def table(result: dict) -> str:
    names = sorted({name for row in result["rows"] for name in row.get("categories_ms", ())})
    lines = ["| path | chunk | max prefill | s (top-2, median) | s (plain) | logprobs MiB | kernels ms | " + " | ".join(names) + " |",
             "|---" * (7 + len(names)) + "|"]  # fmt: skip
    for row in result["rows"]:
        if "unavailable" in row:
            lines.append(f"| {row['path']} | - | {row['max_prefill_tokens']} | {row['unavailable']} |")
            continue
        cats = " | ".join(f"{row['categories_ms'].get(name, 0):.1f}" for name in names)
        lines.append(f"| {row['path']} | {row['chunk']} | {row['max_prefill_tokens'] or '-'} | {row['seconds']:.3f} | {row['plain_s']:.3f} | "
                     f"{row.get('logprobs_extra_mib', '-')} | {row['kernels_ms']:.1f} | {cats} |")  # fmt: skip
    for row in result["rows"]:
        if "unavailable" in row:
            continue
        lines.append(f"\n{row['path']} @ {row['chunk']}, top kernels (ms): " + "; ".join(f"{n[:60]} {ms}" for n, ms in row["top_kernels_ms"][:8]))
        lines.append(f"  clocks over the timed runs: {json.dumps(row['clocks'])}")
        idle = row["device_idle"]
        lines.append(f"  device idle {idle['idle_ms']} ms in {idle['gaps']} gaps; longest: "
                     + "; ".join(f"{g['ms']} ms after {g['after'][:30]} before {g['before'][:30]}" for g in idle["longest"][:4]))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny model and a 256-token prompt (CPU smoke)")
    parser.add_argument("--settings", nargs="*", choices=sorted({path for path, _, _ in SETTINGS}), default=None,
                        help="only these paths (default all)")
    parser.add_argument("--repeats", type=int, default=1, help="timed top-2 prefills per setting: `seconds` is their median, "
                        "`seconds_runs` each (sorted)")
    parser.add_argument("--sustained-gemm-s", type=float, default=0.0, help="after the rows: bf16 8192^3 GEMMs for this long, "
                        "their TFLOP/s at the start and the end and the clocks (common.sustained_gemm)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_prefill_profile.json")


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
