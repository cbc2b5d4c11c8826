"""Split-KV decode attention (`triton_decode.py`, `--split-kv-decode`) on one GPU, off against on:
one model shape (dummy bf16 weights; random K/V in the cache, since attention reads the same bytes
whatever they hold), one runner built once.

Sections, each in its own try/except (one failure keeps the rest); one that would start more than
--budget-s after the start is skipped:
- `attention`: layer 0's paged decode attention alone, per (q, context, batch), the table as wide
  as the graphs' (--contexts' largest): the split count `num_kv_splits` picks, us per call with 1
  split and with it (CUDA events, median of --repeats), max |on - off| of the output and of each
  against the torch twin (fp32 inside; left out above TWIN_MAX_TOKEN_KEYS).
- `graph_decode`: per setting, decode graphs captured for the batches (dropped and captured again
  between settings); per (context, batch): ms of one replay (median of --repeats) and the next
  tokens' argmax agreement with the "off" replay's. On CPU there is no capture (the padded eager
  twin runs, split or not: the switch only reaches the Triton kernel), timed by the host clock.

    sparkwire bench gpu-kernels split-kv --out $OUT/gpu_split_kv_8b.json
    sparkwire bench gpu-kernels split-kv --model ops/model_configs/Qwen3-0.6B --out $OUT/gpu_split_kv_06b.json
    sparkwire bench gpu-kernels split-kv --device cpu --tiny --out /tmp/split_kv.json  # smoke
    TRITON_INTERPRET=1 python ops/bench/gpu_split_kv_check.py --device cpu --tiny --out /tmp/split_kv.json

The attention section needs the kernel: CUDA with Triton, or Triton's CPU interpreter (which takes
H200_SMS for the split count); elsewhere it records why it did not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from ops.bench.common import (
    MODEL_CONFIGS, add_check_arguments, bench_dtype, deadline_sections, device_name, failures, finish_run, median_ms, ragged_step,
    rounded, script, section_rows,
)  # fmt: skip
from services.models import RANDOM_TINY_MODEL
from services.scheduler.model.attention import paged_decode_attention_torch
from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.kv_splits import num_kv_splits
from services.scheduler.model.loader import load_model_runner
from services.scheduler.model.runner import ModelRunner, triton_available

SETTINGS = {"off": False, "on": True}  # ModelRunner.split_kv_decode
H200_SMS = 132
TWIN_MAX_TOKEN_KEYS = 64 * 4096  # query tokens x context the twin gathers (fp32) at most


@dataclass(frozen=True)
class Shape:
    model: Path
    batches: tuple[int, ...]  # decode batch sizes; each a rung of the decode graphs
    contexts: tuple[int, ...]  # seq_len of each decode step (the context + the step's token)
    page: int  # the cache's block size
    query_lens: tuple[int, ...] = (1, 8)  # the attention section's: decode, and a verify block of gamma + 1

    @property
    def max_blocks(self) -> int:
        """Table width of every step and of the graphs: the split count depends on it, not on the context."""
        return -(-max(self.contexts) // self.page)


FULL = Shape(MODEL_CONFIGS / "Qwen3-8B", (1, 64), (256, 4096), 16)
TINY = Shape(RANDOM_TINY_MODEL, (1, 3), (9, 20), 4)


def decode_step(shape: Shape, batch: int, context: int, device: str) -> ForwardBatch:
    """One token per sequence at position context - 1; sequence s owns pages s * max_blocks ..."""
    return ragged_step([(context - 1, 1)] * batch, shape.page, shape.max_blocks, device)


def kernel_here(device: str) -> bool:
    return triton_available() and (device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def num_sms(device: str) -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else H200_SMS


# ---- sections ----


def attention_rows(runner: ModelRunner, shape: Shape, repeats: int) -> list[dict] | dict:
    device = runner.device.type
    if not kernel_here(device):
        return {"skipped": "needs the Triton kernel: CUDA, or TRITON_INTERPRET=1"}
    return [_attention_row(runner, shape, q, context, batch, repeats)
            for q in shape.query_lens for context in shape.contexts for batch in shape.batches if context >= q]  # fmt: skip


def _attention_row(runner: ModelRunner, shape: Shape, q: int, context: int, batch: int, repeats: int) -> dict:
    from services.scheduler.model.triton_decode import paged_block_attention_triton

    config, device = runner.config, runner.device.type
    step = decode_step(shape, batch, context, device)
    gen = torch.Generator(runner.device).manual_seed(context + batch + q)
    query = torch.randn(batch * q, config.num_attention_heads, config.head_dim, generator=gen, device=runner.device)
    args = (query.to(runner.dtype), runner.kv_cache.key_cache(0), runner.kv_cache.value_cache(0), step.seq_lens,
            step.block_tables, config.head_dim**-0.5, q)  # fmt: skip
    splits = num_kv_splits(batch, config.num_key_value_heads, shape.max_blocks, num_sms(device))
    off, on = (paged_block_attention_triton(*args, n).float() for n in (1, splits))
    row = {"q": q, "context": context, "batch": batch, "num_splits": splits,
           "off_us": 1e3 * median_ms(lambda: paged_block_attention_triton(*args, 1), device, repeats),
           "on_us": 1e3 * median_ms(lambda: paged_block_attention_triton(*args, splits), device, repeats),
           "on_vs_off_max_abs_diff": float((on - off).abs().max())}  # fmt: skip
    if batch * q * context <= TWIN_MAX_TOKEN_KEYS:
        twin = paged_decode_attention_torch(*args).float()
        row |= {"off_vs_twin_max_abs_diff": float((off - twin).abs().max()), "on_vs_twin_max_abs_diff": float((on - twin).abs().max())}
    return rounded(row)


def graph_rows(runner: ModelRunner, shape: Shape, repeats: int) -> list[dict]:
    """Per setting, its rows, or one row with the error (a failing "on" keeps the "off" baseline)."""
    rows: list[dict] = []
    off_tokens: dict[tuple[int, int], torch.Tensor] = {}
    for setting in SETTINGS:
        try:
            rows += _graph_rows(runner, shape, setting, repeats, off_tokens)
        except Exception:
            rows.append({"split": setting, "error": traceback.format_exc()[-2000:]})
    return rows


def _graph_rows(runner: ModelRunner, shape: Shape, setting: str, repeats: int, off_tokens: dict) -> list[dict]:
    device, default = runner.device.type, runner.split_kv_decode
    runner.split_kv_decode = SETTINGS[setting]
    rows = []
    try:
        runner.prepare_decode_graphs(ladder=shape.batches, max_blocks_per_seq=shape.max_blocks)  # captures on CUDA
        for context in shape.contexts:
            for size in shape.batches:
                batch = decode_step(shape, size, context, device)
                next_ids = runner.compute_logits(runner.forward(batch).hidden_states).argmax(-1)  # loads the static buffers
                off_ids = off_tokens.setdefault((context, size), next_ids)
                graph = runner.decode_graphs.graphs.get((size, 1))
                step = graph.replay if graph is not None else lambda: runner.forward(batch)  # noqa: B023 (timed at once)
                rows.append(rounded({"split": setting, "context": context, "batch": size, "captured": graph is not None,
                                     "step_ms": median_ms(step, device, repeats),
                                     "tokens_agree_with_off": float((next_ids == off_ids).float().mean())}))  # fmt: skip
    finally:
        runner.drop_decode_graphs()
        runner.split_kv_decode = default
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the graphs' pool, before the next setting captures its own
    return rows


# ---- the run ----


def run(args: argparse.Namespace) -> dict:
    shape = TINY if args.tiny else FULL
    if args.model is not None:  # another shape at the same batches and contexts (e.g. Qwen3-0.6B)
        shape = dataclasses.replace(shape, model=args.model)
    dtype = bench_dtype(args.device)
    deadline = time.monotonic() + args.budget_s
    result: dict = {"device": device_name(args.device), "torch": torch.__version__,
                    "model": shape.model.name, "dtype": str(dtype), "kernel": kernel_here(args.device)}  # fmt: skip
    section = deadline_sections(result, deadline)
    runners: list[ModelRunner] = []
    section("runner", lambda: _load(shape, args.device, dtype, runners))
    for runner in runners:
        section("attention", lambda: attention_rows(runner, shape, args.repeats))
        section("graph_decode", lambda: graph_rows(runner, shape, args.repeats))
    return finish_run(result, args, deadline, table)


def _load(shape: Shape, device: str, dtype: torch.dtype, into: list[ModelRunner]) -> dict:
    start = time.perf_counter()
    num_blocks = max(shape.batches) * shape.max_blocks
    runner = load_model_runner(shape.model, device=device, dtype=dtype, load_format="dummy", num_kv_blocks=num_blocks,
                               kv_block_size=shape.page, cuda_graphs=False)  # fmt: skip
    runner.kv_cache.kv.normal_(generator=torch.Generator(runner.device).manual_seed(0))
    into.append(runner)
    return {"load_s": round(time.perf_counter() - start, 1), "num_blocks": num_blocks, "num_sms": num_sms(device)}


def table(result: dict) -> str:
    lines = [f"device {result['device']}, torch {result['torch']}, {result['model']} {result['dtype']}, "
             f"kernel {'Triton' if result['kernel'] else 'torch twin'}, {result['elapsed_s']} s", "",
             "| what | off | on | splits | agreement |", "|---|---|---|---|---|"]  # fmt: skip
    for name in ("runner", "attention", "graph_decode"):
        value = result.get(name)
        if isinstance(value, dict) and ("error" in value or "skipped" in value):
            lines.append(f"| {name} | | | | {(value.get('error') or value['skipped']).strip().splitlines()[-1][:120]} |")
    for r in section_rows(result, "attention"):
        lines.append(f"| attention q{r['q']} ctx {r['context']} b{r['batch']} us | {r['off_us']} | {r['on_us']} | "
                     f"{r['num_splits']} | max abs on-off {r['on_vs_off_max_abs_diff']:.2e} |")  # fmt: skip
    for row in section_rows(result, "graph_decode"):
        if "error" in row:
            lines.append(f"| graph decode, split {row['split']} | | | | {row['error'].strip().splitlines()[-1][:120]} |")
    steps = {(row["split"], row["context"], row["batch"]): row for row in section_rows(result, "graph_decode") if "error" not in row}
    for context, size in sorted({key[1:] for key in steps}):
        off, on = steps.get(("off", context, size), {}), steps.get(("on", context, size), {})
        lines.append(f"| {'graph' if off.get('captured') else 'padded eager'} decode step ctx {context} b{size} ms | "
                     f"{off.get('step_ms', '')} | {on.get('step_ms', '')} | | next tokens {on.get('tokens_agree_with_off', '')} |")  # fmt: skip
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_check_arguments(parser, tiny="the tiny random model, batches 1 and 3 at contexts 9 and 20", repeats=30, budget_s=40.0,
                        out="gpu_split_kv.json", model=True)


def main(args: argparse.Namespace) -> int:
    return 1 if failures(run(args)) else 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
