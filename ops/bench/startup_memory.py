"""Where a scheduler's start-up memory goes: the stages `sparkwire scheduler` runs (`build.build_core`:
load the target, load the drafter, resolve the settings, capture graphs and compile kernels, assemble
the core), the device memory allocated after each, and a ledger of what the allocation should hold
— the target's and the drafter's weights, their KV caches, the graph pools, the graphs' shared output
buffers — against what it holds: the rest is `unnamed`. On CUDA the unnamed remainder's largest live
allocations are listed by their allocation sites in this repository (`torch.cuda.memory`'s history).

Why: with a drafter on an 80 GB card at the 8B shape start-up ran out of memory at a KV fraction of
0.8 with ~13.8 GiB live that no ledger named (`results/serve.md`). A stage that runs out of memory
ends the run there; what was allocated up to it is still reported.

    sparkwire bench startup-memory --mode static --out $OUT/startup_memory.json   # 8B shape + drafter, dummy weights, CUDA
    sparkwire bench startup-memory --mode static --scheduler-flags "--kv-cache-memory-fraction 0.8" --out ...
    sparkwire bench startup-memory --device cpu --tiny --mode static --out /tmp/startup_memory.json   # smoke
"""

from __future__ import annotations

import argparse
import collections
import gc
import shlex
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ops.bench import scheduler_harness as harness
from ops.bench.common import MODEL_CONFIGS, device_name, script, write_json
from ops.bench.gpu_serve_check import serving_model_dir
from services.models import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL

MODES = ("plain", "static", "compact")
GIB = 2**30
TOP_SITES = 25


def allocated_bytes(device: torch.device) -> int:
    """CUDA: the caching allocator's live bytes; CPU: the bytes of every distinct tensor storage alive."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def ledger(runner, proposer) -> dict[str, int]:
    """Bytes the start-up should hold, by what holds them."""
    named = {"target_weights": sum(t.nbytes for t in {id(p): p for p in runner.model.parameters()}.values())}
    named["target_kv_cache"] = runner.kv_cache.kv.nbytes
    drafter = getattr(proposer, "proposer", proposer)  # DraftGraphs wraps the DSparkProposer
    if drafter is not None:
        target_ids = {id(p) for p in runner.model.parameters()}
        named["drafter_weights"] = sum(p.nbytes for p in drafter.drafter.parameters() if id(p) not in target_ids)
        named["drafter_kv_cache"] = drafter.kv_cache.kv.nbytes
    for name in ("decode_graphs", "ragged_graphs"):
        graphs = getattr(runner, name, None)
        if graphs is not None and getattr(graphs, "shared", None) is not None:
            named[f"{name}_shared_outputs"] = graphs.shared.nbytes
    return named


def pool_bytes(snapshot: dict) -> int:
    return sum(b["size"] for seg in snapshot["segments"] if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
               for b in seg["blocks"] if b["state"] == "active_allocated")  # fmt: skip


def top_sites(snapshot: dict, limit: int = TOP_SITES) -> list[dict[str, Any]]:
    """Live allocations outside the graph pools, summed by their frames in this repository (the
    innermost four and the outermost three)."""
    sites: collections.Counter[str] = collections.Counter()
    for seg in snapshot["segments"]:
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f for f in block.get("frames", []) if "/services/" in f["filename"] or "/ops/" in f["filename"]]
            named = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames]
            # the innermost frames say what allocated, the outermost which start-up stage asked for it
            sites[" < ".join(named if len(named) <= 7 else [*named[:4], "...", *named[-3:]]) or "(no repo frame)"] += block["size"]
    return [{"gib": round(size / GIB, 3), "site": site} for site, size in sites.most_common(limit)]


def scheduler_config(args: argparse.Namespace, model_dir: Path):
    argv = ["--model", str(model_dir), "--device", args.device, "--max-running-requests", str(args.max_running_requests)]
    argv += [] if args.tiny else ["--load-format", "dummy"]
    if args.mode != "plain":
        argv += ["--speculative-algorithm", "dspark", "--draft-model", str(args.draft_model), "--verify-mode", args.mode]
    return harness.scheduler_config(argv + shlex.split(args.scheduler_flags))


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    result: dict[str, Any] = {"device": device_name(args.device), "mode": args.mode, "scheduler_flags": args.scheduler_flags,
                              "stages": []}  # fmt: skip
    if on_cuda:
        result["total_gib"] = round(torch.cuda.mem_get_info(device)[1] / GIB, 2)
    with tempfile.TemporaryDirectory(prefix="sparkwire-startup-memory-") as tmp:
        model_dir = BUNDLED_MODEL if args.tiny else serving_model_dir(args.model_config, Path(tmp) / "model")
        config = scheduler_config(args, model_dir)
        result["kv_cache_memory_fraction"] = config.resolved_kv_cache_memory_fraction
        done: dict[str, Any] = {}
        try:
            for name, call in harness.build_stages(config):
                started = time.perf_counter()
                done[name] = call(done)
                row = {"stage": name, "seconds": round(time.perf_counter() - started, 2),
                       "allocated_gib": round(allocated_bytes(device) / GIB, 3)}  # fmt: skip
                if on_cuda:
                    row["free_gib"] = round(torch.cuda.mem_get_info(device)[0] / GIB, 3)
                result["stages"].append(row)
                print(row, flush=True)
        except Exception:  # out of memory in a stage: what was allocated up to it is the finding
            result["error"] = traceback.format_exc()[-3000:]
        runner, proposer = done.get("load_runner"), done.get("load_proposer")
        allocated = allocated_bytes(device)
        named = ledger(runner, proposer) if runner is not None else {}
        if on_cuda:
            snapshot = torch.cuda.memory._snapshot()
            named["graph_pools"] = pool_bytes(snapshot)
            result["top_sites_outside_pools"] = top_sites(snapshot)
        result["ledger_gib"] = {name: round(value / GIB, 3) for name, value in named.items()}
        result["allocated_gib"] = round(allocated / GIB, 3)
        result["unnamed_gib"] = round((allocated - sum(named.values())) / GIB, 3)
    return result


def table(result: dict) -> str:
    lines = [f"{result['device']}, mode {result['mode']}, KV fraction {result['kv_cache_memory_fraction']}",
             "| stage | s | allocated GiB | free GiB |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['stage']} | {r['seconds']} | {r['allocated_gib']} | {r.get('free_gib', '-')} |" for r in result["stages"]]
    lines += ["", "| held by | GiB |", "|---|---|"]
    lines += [f"| {name} | {gib} |" for name, gib in result["ledger_gib"].items()]
    lines += [f"| **unnamed** (allocated {result['allocated_gib']}) | **{result['unnamed_gib']}** |"]
    lines += [f"  {row['gib']:8.3f} GiB  {row['site']}" for row in result.get("top_sites_outside_pools", [])[:12]]
    if "error" in result:
        lines.append("stopped by: " + result["error"].strip().splitlines()[-1])
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=MODES, default="static", help="plain, or DSpark with this verify mode")
    parser.add_argument("--model-config", type=Path, default=MODEL_CONFIGS / "Qwen3-8B", help="target shape (dummy weights)")
    parser.add_argument("--draft-model", type=Path, default=MODEL_CONFIGS / "Qwen3-8B-dspark", help="draft config (dummy weights)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the bundled pair with its weights (CPU smoke)")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--scheduler-flags", default="", help="more `sparkwire scheduler` flags (e.g. --kv-cache-memory-fraction 0.8)")
    parser.add_argument("--out", type=Path, required=True)


def main(args: argparse.Namespace) -> int:
    if args.tiny:
        args.draft_model = BUNDLED_DRAFT_MODEL
    result = run(args)
    write_json(args.out, result)
    print(table(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
