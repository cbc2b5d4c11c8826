"""Whether `build_core`'s FlashAttention-4 warm-up covers the long prompts (issue 12, point 5): in a
fresh process, the import and `warm_flash4` timed, then the first call at each of several (query,
keys) lengths of the 8B heads (32 q / 8 kv, d 128, bf16). A first call that compiles takes seconds;
one that does not takes the kernel's own milliseconds. Where FA4 cannot run, the JSON says why.

    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:. python3 ops/bench/gpu_flash4_warm_check.py --out $OUT/gpu_flash4_warm.json
    PYTHONPATH=. python ops/bench/gpu_flash4_warm_check.py --device cpu --out /tmp/warm.json  # says why not
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import torch

from ops.bench.gpu_attention_check import synced_seconds
from services.scheduler.model.flash4_attention import attend_sequence_flash4, flash4_unavailable, warm_flash4

REPO = Path(__file__).resolve().parents[2]
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
LENGTHS = ((16384, 16384), (16384, 32768), (32768, 32768), (2049, 2049), (3000, 40000), (16384, 16384))


def run(device: torch.device) -> dict:
    why = flash4_unavailable(device)
    if why is not None:
        return {"unavailable": why}
    start = time.perf_counter()
    importlib.import_module("flash_attn.cute")  # timed: the import is part of the start-up
    result: dict = {"import_s": round(time.perf_counter() - start, 2)}
    result["warm_s"] = synced_seconds(lambda: warm_flash4(device, torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM))
    result["first_calls"] = []
    for q_len, keys in LENGTHS:
        q = torch.randn(q_len, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        k = torch.randn(keys, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        seconds = synced_seconds(lambda: attend_sequence_flash4(q, k, k, HEAD_DIM**-0.5))
        result["first_calls"].append({"query": q_len, "keys": keys, "first_call_s": seconds})
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=REPO / "ops/bench/results/gpu_flash4_warm.json")
    args = parser.parse_args(argv)
    result = run(torch.device(args.device))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
