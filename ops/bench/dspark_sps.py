"""DSpark's step-cost table (SPS): ms of a target verify step against its total tokens T.

`compact` buys verify rows against this table (services/scheduler/spec/step_cost.py): a step of T
tokens is B = ceil(T / (gamma + 1)) sequences of about T / B query tokens each, at `--context`
tokens of context, through the runner as served (decode graphs for uniform steps, ragged graphs
for the rest, the drafter's context layers captured) and the LM head on every row, median of
`--repeats`. The drafter's own step costs the same whatever the verify lengths (it drafts every
request's block), so it is left out. T runs over powers of two and every B * (gamma + 1) of the
batch ladder, up to `--max-batch` sequences. `--save DIR` writes the table as DIR/dspark_sps.json,
the file the scheduler reads beside its drafter.

    sparkwire bench dspark-sps --out $OUT/dspark_sps.json --save $OUT   # the 8B shape, dummy weights
    sparkwire bench dspark-sps --device cpu --tiny --out /tmp/sps.json   # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from ops.bench import scheduler_harness as harness
from ops.bench.common import (MODEL_CONFIGS, RESULTS, bench_dtype, device_name, median_ms, ragged_step, script,
                              write_json)  # fmt: skip
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.loader import load_model_runner
from services.scheduler.model.ragged_graphs import seq_ladder, token_ladder
from services.scheduler.spec.dspark_config import DSparkConfig
from services.scheduler.spec.step_cost import SPS_FILE, StepCost

TARGET = MODEL_CONFIGS / "Qwen3-8B"
DRAFT = MODEL_CONFIGS / "Qwen3-8B-dspark"
BATCH_LADDER = (1, 2, 4, 8, 16, 32, 64, 128)


def token_counts(gamma: int, max_batch: int) -> list[int]:
    width = gamma + 1
    powers = [1 << i for i in range((max_batch * width).bit_length()) if 1 << i <= max_batch * width]
    return sorted({*powers, *(b * width for b in BATCH_LADDER if b <= max_batch)})


def verify_step(num_tokens: int, gamma: int, context: int, page: int, device: str):
    """A ragged batch of `num_tokens` query tokens over ceil(T / (gamma + 1)) sequences, as even as can be."""
    num_seqs = -(-num_tokens // (gamma + 1))
    queries = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    width = -(-(context + gamma + 1) // page)
    return ragged_step([(context, q) for q in queries], page, width, device), num_seqs * width


def load_runner(target: Path, draft: DSparkConfig, args: argparse.Namespace):
    """The target with dummy weights, KV for the largest step, graphs as `build_core` prepares them."""
    width = -(-(args.context + draft.block_size + 1) // args.page)
    runner = load_model_runner(target, device=args.device, dtype=bench_dtype(args.device), load_format="dummy",
                               kv_block_size=args.page, num_kv_blocks=args.max_batch * width + 1, cuda_graphs=False)  # fmt: skip
    layers = tuple(draft.target_layer_ids)
    if runner.decode_kernel:
        runner.prepare_decode_graphs(query_lens=(1, draft.block_size + 1), capture_layers=layers)
    if runner.ragged_kernel:
        budget = max(harness.CHUNKED_PREFILL_SIZE, args.max_batch * (draft.block_size + 1))
        runner.prepare_ragged_graphs(seq_ladder(args.max_batch), token_ladder(budget), capture_layers=layers)
        runner.ragged_graphs.capture_keys(runner.ragged_graphs.verify_keys(draft.block_size + 1), "verify")
    return runner


def profile(runner, gamma: int, capture_layers: tuple[int, ...], max_batch: int, context: int, repeats: int,
            deadline: float = float("inf")) -> list[dict]:  # fmt: skip
    """[{tokens, seqs, ms}] for every T of `token_counts`, until the deadline."""
    rows = []
    device = runner.device.type
    for num_tokens in token_counts(gamma, max_batch):
        if time.monotonic() > deadline:
            break
        batch, _ = verify_step(num_tokens, gamma, context, runner.block_size, device)
        batch = dataclasses.replace(batch, capture_layers=capture_layers)

        def step(batch=batch):
            out = runner.forward(batch)  # a decode graph computes every row's logits itself, as served
            return out.logits if out.logits is not None else runner.compute_logits(out.hidden_states)

        rows.append({"tokens": num_tokens, "seqs": batch.num_seqs, "ms": median_ms(step, device, repeats)})
    return rows


def step_cost(rows: list[dict]) -> StepCost:
    """The table as the scheduler reads it (seconds; each point no cheaper than the one before):
    each T costs the least measured at T or at any larger step. A slow outlier (a shared machine, a
    capture inside the timing) then stays one point's error instead of raising every larger T to
    it, which would make the verify budget buy no drafts at all past it."""
    points, ceiling = [], float("inf")
    for row in reversed(rows):
        ceiling = min(ceiling, row["ms"] / 1e3)
        points.append((row["tokens"], ceiling))
    return StepCost(tuple(reversed(points)))


def table(result: dict) -> str:
    lines = ["| tokens | seqs | ms | ms / token |", "|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['seqs']} | {r['ms']:.3f} | {r['ms'] / r['tokens']:.4f} |" for r in result["rows"]]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, default=TARGET, help="target config directory (dummy weights)")
    parser.add_argument("--draft", type=Path, default=DRAFT, help="draft config directory: gamma and the captured layers")
    parser.add_argument("--tiny", action="store_true", help="the tiny random target and a one-layer draft config for it (smoke)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for the smoke run")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="context tokens of every sequence")
    parser.add_argument("--page", type=int, default=harness.KV_BLOCK_SIZE)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=180, help="token counts not started by then are skipped")
    parser.add_argument("--save", type=Path, default=None, help=f"write the table as DIR/{SPS_FILE} (beside a drafter)")
    parser.add_argument("--out", type=Path, default=RESULTS / "dspark_sps.json")


def main(args: argparse.Namespace) -> int:
    if not args.tiny:
        return measure(args)
    return harness.on_tiny_pair(args, measure)


def measure(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.budget_s
    draft = DSparkConfig.from_pretrained(args.draft)
    draft.check_target(ModelConfig.from_pretrained(args.target))
    runner = load_runner(args.target, draft, args)
    rows = profile(runner, draft.block_size, tuple(draft.target_layer_ids), args.max_batch, args.context, args.repeats, deadline)
    result = {"device": device_name(args.device), "target": str(args.target), "gamma": draft.block_size, "context": args.context,
              "rows": rows, "points": [list(p) for p in step_cost(rows).points]}  # fmt: skip
    if args.save is not None:
        step_cost(rows).save(args.save / SPS_FILE, device=result["device"], target=str(args.target), context=args.context)
    write_json(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
