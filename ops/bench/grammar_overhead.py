"""What structured output adds to a decode step (services/scheduler/grammar.py), CPU or GPU.

Three figures per batch size B, in microseconds (medians):

- fill:   `GrammarMatchers.bitmask` for B constrained sequences, `width` rows each (1: plain decoding;
          K + 1: a DSpark verify block of K drafts, every draft valid so the matcher walks and rolls
          back all of them) — the host work, which the worker does while the device runs the forward
- apply:  `apply_token_bitmask` over the B x width rows of logits [rows, V]
- step:   `core.step` wall time of a plain greedy decode step on the bundled micro model, every
          request under a JSON schema against none (the forward included, so only the difference
          says anything; on a GPU the fill overlaps the forward, `--device cuda`, bf16)

Sequences sit at spread positions of a valid answer (`ANSWER`) so the matchers are in varied states.

    sparkwire bench grammar-overhead --out ops/bench/results/grammar_overhead.json
    sparkwire bench grammar-overhead --device cuda --out grammar_overhead_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from contracts.scheduler import Grammar, GrammarKind, SamplingParams
from ops.bench import scheduler_harness as harness
from ops.bench.common import bench_dtype, device_name, synchronize, write_json
from services.models import BUNDLED_MODEL
from services.scheduler.grammar import GrammarBlock, GrammarMatchers
from services.scheduler.logits_processing import apply_token_bitmask
from services.scheduler.model import load_model_runner

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 8},
        "ok": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["id", "name", "tags", "ok", "score"],
}
ANSWER = '{"id": 4242, "name": "a fairly long name of a thing", "tags": ["red", "blue", "green", "red"], "ok": true, "score": 0.125}'
GRAMMAR = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))


def _median_us(call, repeats: int, device: str = "cpu") -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def fill_and_apply(model: Path, batch: int, width: int, repeats: int, device: str) -> dict[str, float]:
    config = json.loads((model / "config.json").read_text())
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    matchers = GrammarMatchers(str(model), config["vocab_size"], eos)
    answer = Tokenizer.from_file(str(model / "tokenizer.json")).encode(ANSWER, add_special_tokens=False).ids
    room = len(answer) - width
    positions = [room * b // max(batch, 1) for b in range(batch)]
    blocks = [GrammarBlock(f"r{b}", GRAMMAR, answer, 0, p, answer[p : p + width - 1]) for b, p in enumerate(positions)]
    matchers.bitmask(blocks, width)  # compile, matchers caught up: what a running batch has
    logits = torch.randn(batch * width, config["vocab_size"], device=device)
    mask = matchers.bitmask(blocks, width).masks.to(device)
    return {
        "fill_us": _median_us(lambda: matchers.bitmask(blocks, width, pin=device == "cuda"), repeats),
        "apply_us": _median_us(lambda: apply_token_bitmask(logits, mask), repeats, device),
    }


def step_times(runner, model: Path, batch: int, steps: int, device: str) -> dict[str, float]:
    found = {}
    for name, grammar in (("plain", None), ("grammar", GRAMMAR)):
        core = harness.core_for(runner, max_running_requests=batch, chunked_prefill_size=4096, tokenizer_dir=str(model))
        sampling = SamplingParams(max_new_tokens=steps + 4, temperature=0.0, ignore_eos=True, grammar=grammar)
        prompts = np.random.default_rng(0).integers(10, 4000, size=(batch, 16)).astype(np.int32)
        for b in range(batch):
            core.add(harness.new_request(f"r{b}", prompts[b], sampling))
        core.step()  # the prefill
        times = []
        for _ in range(steps):
            synchronize(device)
            start = time.perf_counter()
            core.step()
            synchronize(device)
            times.append(time.perf_counter() - start)
        found[f"step_{name}_us"] = 1e6 * statistics.median(times)
    found["step_overhead_us"] = found["step_grammar_us"] - found["step_plain_us"]
    return found


def run(args: argparse.Namespace) -> dict:
    deadline = time.monotonic() + args.budget_s
    torch.set_num_threads(args.threads)
    result: dict = {"model": args.model.name, "device": device_name(args.device), "threads": args.threads, "rows": []}
    runner = load_model_runner(args.model, device=args.device, dtype=bench_dtype(args.device), num_kv_blocks=2048, kv_block_size=16)
    for batch in args.batches:
        for width in args.widths:
            if time.monotonic() > deadline:
                result["cut_short"] = True
                break
            row = {"batch": batch, "width": width, **fill_and_apply(args.model, batch, width, args.repeats, args.device)}
            if width == 1:
                row |= step_times(runner, args.model, batch, args.steps, args.device)
            result["rows"].append({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
    return result


def table(result: dict) -> str:
    lines = ["| batch | rows/seq | fill us | per row us | apply us | step plain us | step grammar us |", "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        per_row = row["fill_us"] / (row["batch"] * row["width"])
        lines.append(f"| {row['batch']} | {row['width']} | {row['fill_us']:.0f} | {per_row:.1f} | {row['apply_us']:.0f} | "
                     f"{row.get('step_plain_us', float('nan')):.0f} | {row.get('step_grammar_us', float('nan')):.0f} |")  # fmt: skip
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="a model directory with tokenizer.json")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 8], help="rows per sequence: 1 plain, K + 1 with K drafts")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per core")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the figures' machine shares its cores)")
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--out", type=Path, default=Path("grammar_overhead.json"))


def main(args: argparse.Namespace) -> int:
    result = run(args)
    write_json(args.out, result)
    print(table(result))
    return 0
