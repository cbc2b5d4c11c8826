"""Torch ops dispatched per decode step, with and without output logprobs, on the CPU.

Each op costs host time (~10-20 us on the H200 host) and each one that launches work a kernel
outside the CUDA graph: the counts are what output logprobs add to a step on the eager path (the
CPU, or CUDA with `--no-logprob-cuda-graphs`). On CUDA the default replays output logprobs from
graphs, whose per-call host cost is 3 copies raw / 7 processed plus the replay
(`test_logprob_graphs.py`). Measured on the bundled tiny model (fp32) with a `TorchDispatchMode`
around `SchedulerCore.step`, for

- plain decode (one row per request) and a DSpark verify step (gamma + 1 rows per request; a
  random drafter, every verify keeping `ACCEPT_LEN - 1` drafts: `SimulatedAcceptWorker`),
- at each batch size, with no logprobs, top-20 for every request (raw and processed mode), and a
  mix (half the requests: top-5 and two requested ids; the other half: none).

"ops" counts every aten call, "kernels" leaves out those returning a view of an input (views, and
`to`/`reshape` with nothing to do). "added" is the
step's count with logprobs minus without. No times: on the CPU the tiny model's step says nothing
about the H200's (`sparkwire bench gpu-core --logprob-cost` times it there).

    sparkwire bench logprob-ops --out ops/bench/results/logprob_ops.json
"""

from __future__ import annotations

import argparse
import functools
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from contracts.scheduler import LogprobParams, SamplingParams
from services.models import RANDOM_TINY_MODEL
from ops.bench import scheduler_harness as harness
from ops.bench.common import RESULTS, script, write_json
from services.scheduler.model import load_model_runner

TOP20 = LogprobParams(return_logprob=True, top_logprobs_num=20)
MIXED = LogprobParams(return_logprob=True, top_logprobs_num=5, token_ids_logprob=(7, 3))
PROMPT_LEN = 12
ACCEPT_LEN = 4  # DSpark: every verify keeps 3 drafts + 1 token (SimulatedAcceptWorker)


class OpCounter(TorchDispatchMode):
    """Counts aten calls by name, and apart those that launch work: all but calls returning a view of
    an input (a view op, or `to`/`reshape`/`contiguous` finding nothing to do)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.kernels: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func.name()] += 1
        if not _is_view(func, args, out):
            self.kernels[func.name()] += 1
        return out

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_kernels(self) -> int:
        return sum(self.kernels.values())


def _is_view(func, args, out) -> bool:
    if not _returns_alias(func):
        return False
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    outs = out if isinstance(out, (tuple, list)) else [out]
    return all(o.untyped_storage().data_ptr() in inputs for o in outs if isinstance(o, torch.Tensor))


@functools.cache
def _returns_alias(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _requests(batch: int, logprobs: str, vocab: int) -> list:
    prompts = np.random.default_rng(batch).integers(0, vocab, size=(batch, PROMPT_LEN), dtype=np.int32)
    sampling = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    kinds = {"none": (LogprobParams(),), "top20": (TOP20,), "mixed": (MIXED, LogprobParams())}[logprobs]
    return [harness.new_request(f"r{i}", p, sampling, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]


def _core(runner, kind: str, logprobs_mode: str, accept_len: int):
    if kind == "plain":
        return harness.core_for(runner, max_running_requests=128, chunked_prefill_size=4096, logprobs_mode=logprobs_mode)
    return harness.core_for(runner, max_running_requests=128, chunked_prefill_size=4096, logprobs_mode=logprobs_mode,
                            proposer=harness.random_dspark_proposer(runner, block_size=7), simulated_accept_len=accept_len)  # fmt: skip


def count_step(runner, kind: str, batch: int, logprobs: str, logprobs_mode: str = "raw") -> dict:
    """Ops of one decode (or verify) step, after the prefill and two warm steps."""
    core = _core(runner, kind, logprobs_mode, ACCEPT_LEN)
    for r in _requests(batch, logprobs, runner.config.vocab_size):
        core.add(r)
    for _ in range(3):
        core.step()
    with OpCounter() as counter:
        core.step()
    return {"ops": counter.num_ops, "kernels": counter.num_kernels,
            "by_op": dict(counter.ops.most_common()), "kernels_by_op": dict(counter.kernels.most_common())}  # fmt: skip


def run(out: Path, batches=(1, 64)) -> dict:
    torch.manual_seed(0)
    runner = load_model_runner(RANDOM_TINY_MODEL, device="cpu", dtype=torch.float32, num_kv_blocks=1024, kv_block_size=16)
    rows = []
    for kind in ("plain", "dspark"):
        for batch in batches:
            base = count_step(runner, kind, batch, "none")
            for logprobs, mode in (("top20", "raw"), ("top20", "processed"), ("mixed", "raw")):
                row = count_step(runner, kind, batch, logprobs, mode)
                rows.append({"step": kind, "batch": batch, "logprobs": logprobs, "mode": mode,
                             "ops": row["ops"], "kernels": row["kernels"],
                             "added_ops": row["ops"] - base["ops"], "added_kernels": row["kernels"] - base["kernels"],
                             "added_by_op": _difference(row["by_op"], base["by_op"]),
                             "added_kernels_by_op": _difference(row["kernels_by_op"], base["kernels_by_op"])})  # fmt: skip
    result = {"model": RANDOM_TINY_MODEL.name, "torch": torch.__version__, "rows": rows}
    write_json(out, result)
    print(table(rows))
    return result


def _difference(with_lp: dict[str, int], without: dict[str, int]) -> dict[str, int]:
    names = sorted(set(with_lp) | set(without), key=lambda n: -(with_lp.get(n, 0) - without.get(n, 0)))
    return {n: with_lp.get(n, 0) - without.get(n, 0) for n in names if with_lp.get(n, 0) != without.get(n, 0)}


def table(rows: list[dict]) -> str:
    lines = ["| step | batch | logprobs | mode | ops (added) | kernels (added) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['batch']} | {r['logprobs']} | {r['mode']} | {r['ops']} ({r['added_ops']:+d}) | "
                     f"{r['kernels']} ({r['added_kernels']:+d}) |")  # fmt: skip
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 64])
    parser.add_argument("--out", type=Path, default=RESULTS / "logprob_ops.json")


def main(args: argparse.Namespace) -> int:
    run(args.out, tuple(args.batches))
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
