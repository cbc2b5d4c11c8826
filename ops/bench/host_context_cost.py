"""Host time of a decode step against the context length, on the CPU: the scheduler core's own work.

`host_step_cost.py` times a decode step's host pieces at 16-token prompts; a sequence's KV block
table grows with its context (one id per 16 tokens: 2,048 at 32k), and whatever the host does per
block id each step grows with it. Here the core decodes `--batch` sequences at each `--contexts`
length with the model's forward replaced by a fixed output of the right shape (its compute is not
what is measured; the rest of the step, planning, host arrays, upload, readback, results and
update, runs as served), and the milliseconds per decode step are the best of `--repeats` timed
runs of `--steps` steps. `--repetition-penalty R` gives every request that penalty (its logits then
depend on every token the request has seen; overlapped decoding is off for it, as served).
`--before PATH` runs that tree's own copy of this script too, alternately.

    sparkwire bench host-context --before DIR --rounds 2 --out ops/bench/results/host_context_cost.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from contracts.scheduler import LogprobParams, SamplingParams
from services.models import RANDOM_TINY_MODEL
from ops.bench import scheduler_harness as harness
from ops.bench.common import REPO, RESULTS, script, write_json
from services.scheduler.model import load_model_runner
from services.scheduler.model.batch import ForwardOutput

BLOCK_SIZE = 16


def measure(context: int, batch: int, steps: int, repeats: int, repetition_penalty: float = 1.0) -> dict:
    """ms per decode step, best of `repeats` runs of `steps`, once every sequence decodes."""
    num_blocks = batch * (context // BLOCK_SIZE + 8 + -(-steps * (repeats + 2) // BLOCK_SIZE)) + 16
    runner = load_model_runner(RANDOM_TINY_MODEL, device="cpu", dtype=torch.float32, load_format="dummy",
                               num_kv_blocks=num_blocks, kv_block_size=BLOCK_SIZE)  # fmt: skip
    hidden, vocab = runner.config.hidden_size, runner.config.vocab_size
    runner.forward = lambda batch: ForwardOutput(torch.zeros(batch.num_tokens, hidden))  # the model's compute left out
    runner.compute_logits = lambda states: torch.zeros(states.shape[0], vocab)
    core = harness.core_for(runner, max_running_requests=batch, chunked_prefill_size=16384, max_prefill_tokens=1 << 22,
                            max_model_len=context + steps * (repeats + 2) + 16)  # fmt: skip
    sampling = SamplingParams(max_new_tokens=steps * (repeats + 2), temperature=0.0, ignore_eos=True, repetition_penalty=repetition_penalty)
    prompt = np.arange(context, dtype=np.int32) % vocab
    for index in range(batch):
        core.add(harness.new_request(f"r{index}", prompt, sampling, LogprobParams()))
    while harness.core_counts(core)["waiting"] or harness.last_step(core) is None or harness.last_step(core).num_prefill_tokens:
        core.step()  # the prompts' chunks, until a step decodes every sequence
    for _ in range(steps):
        core.step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        times.append((time.perf_counter() - start) / steps)
    counts = harness.core_counts(core)
    assert counts["running"] == batch and counts["preemptions"] == 0, "every sequence decoded in every timed step"
    return {"context": context, "batch": batch, "repetition_penalty": repetition_penalty, "ms_per_step": round(1e3 * min(times), 3),
            "ms_per_step_all": [round(1e3 * t, 3) for t in times], "block_ids_per_step": batch * -(-context // BLOCK_SIZE)}  # fmt: skip


def run(contexts, batch: int, steps: int, repeats: int, repetition_penalty: float) -> dict:
    torch.set_num_threads(1)
    rows = [measure(c, batch, steps, repeats, repetition_penalty) for c in contexts]
    return {"batch": batch, "steps": steps, "repeats": repeats, "rows": rows}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 4096, 32768])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--before", type=Path, help="another tree to measure with its own copy of this script, in the same run")
    parser.add_argument("--rounds", type=int, default=2, help="with --before: alternate rounds of each tree")
    parser.add_argument("--out", type=Path, default=RESULTS / "host_context_cost.json")
    parser.add_argument("--print-json", action="store_true", help=argparse.SUPPRESS)  # a subprocess's output


def main(args: argparse.Namespace) -> int:
    common = ["--contexts", *map(str, args.contexts), "--batch", str(args.batch), "--steps", str(args.steps),
              "--repeats", str(args.repeats), "--repetition-penalty", str(args.repetition_penalty)]  # fmt: skip
    if args.before is None:
        result = run(args.contexts, args.batch, args.steps, args.repeats, args.repetition_penalty)
        if args.print_json:
            print(json.dumps(result))
            return 0
        trees = {"this": result}
    else:
        from ops.bench.other_tree import alternate  # the parent's only: the child imports from the other tree

        runs = alternate(__file__, {"before": args.before.resolve(), "after": REPO}, common, args.rounds)
        trees = {name: {**results[-1], "rows": [min(same, key=lambda r: r["ms_per_step"]) for same in zip(*(r["rows"] for r in results))],
                        "rounds": len(results), "tree": str(args.before.resolve() if name == "before" else REPO)}
                 for name, results in runs.items()}  # fmt: skip
        result = trees
    write_json(args.out, result)
    print("| tree | batch | context | repetition penalty | block ids a step | ms per decode step (host) |")
    print("|---|---|---|---|---|---|")
    for name, tree in trees.items():
        for r in tree["rows"]:
            print(f"| {name} | {r['batch']} | {r['context']} | {r.get('repetition_penalty', 1.0)} | {r['block_ids_per_step']} | {r['ms_per_step']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
