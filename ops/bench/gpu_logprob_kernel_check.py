"""The fused raw-mode logprob kernels (`triton_logprobs.py`, issue 12 points 4 and 5) against the torch
path on one GPU, at the Qwen3-8B vocabulary (V = 151936), both in one run.

Sections, each in its own try/except (one failure keeps the rest); one that would start more than
--budget-s after the start is skipped:
- `rows`: output rows as a decode step has them (f32 logits, bf16-valued: a bf16 model's ties), k=20,
  per row count (1, 64, 512): ms of `logprob_columns` eagerly and replayed from a CUDA graph (CUDA
  events, median of --repeats), torch path and kernels; max |diff| of the values (token and top-k)
  and whether the top-k ids are equal.
- `greedy`: a greedy decode step's rows (f32, k=20, 1 and 64 rows; `LogprobGraphs.greedy`'s work)
  where the kernels run: the argmax as a kernel of its own, then the kernels over it as targets
  (`before`), against the kernels taking the argmax in their first pass (`after`, `argmax_targets`):
  ms eagerly and from a CUDA graph, each kernel's device ms, and whether the tokens and columns agree.
- `prompt_chunk`: one fused prompt chunk, 1024 bf16 rows, k=2, the same columns.
- `prompt_32k`: a whole 32768-row prompt's top-2 through `logprobs_on_device` with an LM head
  ([151936, 4096] bf16 weight) over random [32768, 4096] bf16 hidden states, each path in its own
  chunks: ms (median of --prompt-repeats), the extra memory it allocated at its peak
  (torch.cuda.max_memory_allocated over what was allocated before: issue 12 asks <= 1 GiB), and the
  LM head alone over the same chunks as the floor; the same correctness columns.

    sparkwire bench gpu-kernels logprobs --out $OUT/gpu_logprob_kernel.json
    sparkwire bench gpu-kernels logprobs --device cpu --tiny --out /tmp/lpk.json  # smoke, torch only
    TRITON_INTERPRET=1 python ops/bench/gpu_logprob_kernel_check.py --device cpu --tiny --out /tmp/lpk.json

On CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1); elsewhere the "kernel"
path is left out. On CPU nothing is captured: the graph columns stay empty.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from ops.bench.common import (
    add_check_arguments, deadline_sections, device_name, failures, finish_run, median_ms, rounded, script, section_rows, self_us,
)  # fmt: skip
from services.scheduler.logprobs import (
    LogprobQuery,
    TopKKeys,
    logprob_columns,
    logprob_inputs,
    logprobs_on_device,
    max_chunk_rows,
)
from services.scheduler.model.runner import triton_available

PATHS = {"torch": False, "kernel": True}  # logprob_columns' fused switch


@dataclass(frozen=True)
class Shape:
    vocab: int
    rows: tuple[int, ...]  # output rows per step
    top_k: int  # output rows' k
    chunk_rows: int  # the prompt chunk section's rows
    prompt_rows: int
    hidden: int
    prompt_k: int = 2


FULL = Shape(151936, (1, 64, 512), 20, 1024, 32768, 4096)
# Few rows: in Triton's interpreter the cost is per row and per call (~0.1 s), and --sweep runs every
# row count and the chunk (twice: both prompt counts are the chunk's here) at 8 layouts.
TINY = Shape(1000, (1, 3), 20, 4, 40, 32)


def paths_here(device: str) -> tuple[str, ...]:
    """"torch", and "kernel" where the kernels run: CUDA with Triton, or Triton's CPU interpreter."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return ("torch", "kernel") if triton_available() and (device == "cuda" or interpreted) else ("torch",)


def bf16_valued(num_rows: int, vocab: int, device: str, generator: torch.Generator) -> torch.Tensor:
    return (4 * torch.randn(num_rows, vocab, generator=generator, device=device)).to(torch.bfloat16)  # [n, V]


def agreement(want: tuple, got: tuple) -> dict:
    """Max |diff| over the token and top-k values; whether the top-k ids are equal."""
    diff = max(float((a.float() - b.float()).abs().max()) if a.numel() else 0.0 for a, b in ((want[0], got[0]), (want[1], got[1])))
    return {"max_abs_diff": diff, "ids_equal": bool(torch.equal(want[2], got[2]))}


def graph_ms(call, device: str, repeats: int) -> float | None:
    """ms of one replay of `call` captured in a CUDA graph; None off CUDA."""
    if device != "cuda":
        return None
    from services.scheduler.model.graphs import capture_graph

    graph, _ = capture_graph(call)
    return median_ms(graph.replay, device, repeats)


# ---- sections ----


def rows_section(shape: Shape, device: str, paths: tuple[str, ...], repeats: int) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(0)
    keys = TopKKeys.build(shape.vocab, device)
    rows = []
    for num_rows in shape.rows:
        logits = bf16_valued(num_rows, shape.vocab, device, generator).float()  # f32 [n, V], as verify rows are
        targets = logits.argmax(dim=-1)
        row = {"rows": num_rows, "k": shape.top_k, "dtype": "float32"}
        rows.append(_compare(row, paths, device, repeats, lambda fused: logprob_columns(logits, targets, shape.top_k, None, None, keys, fused)))
    return rows


def greedy_section(shape: Shape, device: str, repeats: int) -> list[dict]:
    """The kernels for a greedy step's rows: argmax first (before), or taken in their first pass (after)."""
    from services.scheduler.triton_logprobs import raw_logprob_columns

    generator = torch.Generator(device=device).manual_seed(4)
    rows = []
    for num_rows in shape.rows[:2]:
        logits = bf16_valued(num_rows, shape.vocab, device, generator).float()  # f32 [n, V], a decode graph's logits
        tokens = {name: torch.empty(num_rows, dtype=torch.int64, device=device) for name in ("before", "after")}

        def before(tokens=tokens["before"], logits=logits):
            torch.argmax(logits, dim=-1, out=tokens)
            return raw_logprob_columns(logits, tokens, shape.top_k, None)

        def after(tokens=tokens["after"], logits=logits):
            return raw_logprob_columns(logits, tokens, shape.top_k, None, argmax_targets=True)

        row: dict = {"rows": num_rows, "k": shape.top_k, "dtype": "float32"}
        outputs = {"before": before(), "after": after()}
        for name, call in (("before", before), ("after", after)):
            row[f"{name}_ms"] = median_ms(call, device, repeats)
            row[f"{name}_graph_ms"] = graph_ms(call, device, repeats)
            row[f"{name}_kernels_device_ms"] = _kernel_device_ms(call, device)
        row["tokens_equal"] = bool(torch.equal(tokens["before"], logits.argmax(dim=-1)) and torch.equal(tokens["after"], tokens["before"]))
        rows.append(rounded(row | agreement(outputs["before"], outputs["after"])))
    return rows


def prompt_chunk_section(shape: Shape, device: str, paths: tuple[str, ...], repeats: int) -> dict:
    generator = torch.Generator(device=device).manual_seed(1)
    logits = bf16_valued(shape.chunk_rows, shape.vocab, device, generator)  # bf16 [c, V], as the LM head gives them
    targets = torch.randint(0, shape.vocab, (shape.chunk_rows,), generator=generator, device=device)
    keys = TopKKeys.build(shape.vocab, device)
    row = {"rows": shape.chunk_rows, "k": shape.prompt_k, "dtype": "bfloat16"}
    return _compare(row, paths, device, repeats, lambda fused: logprob_columns(logits, targets, shape.prompt_k, None, None, keys, fused))


# (BLOCK, target programs) the layout sweep tries after the default (`triton_logprobs.BLOCK`, `TARGET_PROGRAMS`)
OTHER_LAYOUTS = ((1024, 264), (1024, 528), (1024, 1024), (2048, 264), (2048, 1024), (2048, 2048), (4096, 528))


def layout_section(shape: Shape, device: str, repeats: int) -> list[dict]:
    """The kernels at other column tiles (BLOCK) and programs per step (more splits a row), on prompt
    rows (bf16, k=2: the chunk, and a short prompt's 128) and output rows (f32, k=20: each of the
    `rows` section's counts): ms eagerly and replayed from a CUDA graph (a step runs them graphed: the
    eager figure is mostly three launches at tens of rows), each kernel's device ms, and agreement
    with the torch path (the split count changes the log-sum-exp's order of additions, not the
    top-k). The default: `triton_logprobs.BLOCK` and `TARGET_PROGRAMS`."""
    from services.scheduler.triton_logprobs import BLOCK, TARGET_PROGRAMS, raw_logprob_columns, split_layout

    generator = torch.Generator(device=device).manual_seed(3)
    keys = TopKKeys.build(shape.vocab, device)
    cases = []
    prompt_rows = [(n, shape.prompt_k, torch.bfloat16) for n in (shape.chunk_rows, min(128, shape.chunk_rows))]
    for num_rows, k, dtype in [*prompt_rows, *((n, shape.top_k, torch.float32) for n in shape.rows)]:
        logits = bf16_valued(num_rows, shape.vocab, device, generator).to(dtype)
        targets = torch.randint(0, shape.vocab, (num_rows,), generator=generator, device=device)
        cases.append((num_rows, k, dtype, logits, targets, logprob_columns(logits, targets, k, None, None, keys, False)))
    rows = []
    for block, programs in dict.fromkeys(((BLOCK, TARGET_PROGRAMS), *OTHER_LAYOUTS)):  # the default first, once
        for num_rows, k, dtype, logits, targets, want in cases:
            call = lambda: raw_logprob_columns(logits, targets, k, None, block=block, target_programs=programs)  # noqa: E731
            token, values, ids, _ = call()
            splits = split_layout(num_rows, shape.vocab, max(2, 1 << (k - 1).bit_length()), block, target_programs=programs)[0]
            row = {"block": block, "target_programs": programs, "splits": splits, "rows": num_rows, "k": k, "dtype": str(dtype).removeprefix("torch."),
                   "kernel_ms": median_ms(call, device, repeats), "kernel_graph_ms": graph_ms(call, device, repeats),
                   "kernels_device_ms": _kernel_device_ms(call, device)} | agreement(want, (token, values, ids))  # fmt: skip
            rows.append(rounded(row))
    return rows


def _kernel_device_ms(call, device: str, calls: int = 20) -> dict | None:
    """Each kernel's mean device ms per call (torch.profiler over `calls` eager calls); None off CUDA."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return {event.key: round(self_us(event, cuda=True) / 1e3 / calls, 4) for event in prof.key_averages()
            if self_us(event, cuda=True) > 0 and "_kernel" in event.key}  # fmt: skip


def _compare(row: dict, paths: tuple[str, ...], device: str, repeats: int, call) -> dict:
    outputs = {}
    for path in paths:
        outputs[path] = call(PATHS[path])
        row[f"{path}_ms"] = median_ms(lambda: call(PATHS[path]), device, repeats)
        row[f"{path}_graph_ms"] = graph_ms(lambda: call(PATHS[path]), device, repeats)
    if "kernel" in outputs:
        row |= agreement(outputs["torch"], outputs["kernel"])
        row["kernels_device_ms"] = _kernel_device_ms(lambda: call(PATHS["kernel"]), device)
    return rounded(row)


def prompt_section(shape: Shape, device: str, paths: tuple[str, ...], repeats: int) -> dict:
    """A whole prompt's top-k through the LM head, each path in its own chunks."""
    generator = torch.Generator(device=device).manual_seed(2)
    dtype = torch.bfloat16
    hidden = (torch.randn(shape.prompt_rows, shape.hidden, generator=generator, device=device) / 4).to(dtype)  # [N, H]
    weight = (torch.randn(shape.vocab, shape.hidden, generator=generator, device=device) / 16).to(dtype)  # [V, H]
    targets = np.random.default_rng(3).integers(0, shape.vocab, shape.prompt_rows)
    queries = [LogprobQuery(np.arange(shape.prompt_rows), targets, shape.prompt_k, ())]
    inputs = {name: torch.from_numpy(a).to(device) for name, a in logprob_inputs(queries, False, shape.prompt_rows).items()}
    keys = TopKKeys.build(shape.vocab, device)

    def head(rows: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(rows, weight)  # [c, V] bf16, as runner.head_logits

    def run(fused: bool):
        return logprobs_on_device(queries, inputs, hidden, head, keys, False, fused=fused)

    result: dict = {"rows": shape.prompt_rows, "k": shape.prompt_k, "hidden": shape.hidden}
    result["head_alone_ms"] = median_ms(lambda: _head_only(hidden, head, shape.vocab), device, repeats, warmup=1)
    outputs = {}
    for path in paths:
        outputs[path], result[f"{path}_extra_bytes"] = _peak_extra(lambda: run(PATHS[path]), device)
        result[f"{path}_ms"] = median_ms(lambda: run(PATHS[path]), device, repeats, warmup=0)
    if "kernel" in outputs:
        result |= agreement(outputs["torch"].columns(), outputs["kernel"].columns())
    return rounded(result)


def _head_only(hidden: torch.Tensor, head, vocab: int) -> None:
    """The LM head over the torch path's chunks, nothing kept: the floor of either path."""
    step = max_chunk_rows(vocab)
    for start in range(0, hidden.shape[0], step):
        head(hidden[start : start + step])


def _peak_extra(call, device: str) -> tuple[object, int | None]:
    """(call's result, bytes it allocated at its peak over what was allocated before; None off CUDA)."""
    if device != "cuda":
        return call(), None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


# ---- the run ----


def run(args: argparse.Namespace) -> dict:
    shape = TINY if args.tiny else FULL
    paths = paths_here(args.device)
    deadline = time.monotonic() + args.budget_s
    result: dict = {"device": device_name(args.device), "torch": torch.__version__,
                    "vocab": shape.vocab, "paths": list(paths)}  # fmt: skip
    section = deadline_sections(result, deadline)
    section("rows", lambda: rows_section(shape, args.device, paths, args.repeats))
    if "kernel" in paths:
        section("greedy", lambda: greedy_section(shape, args.device, args.repeats))
    section("prompt_chunk", lambda: prompt_chunk_section(shape, args.device, paths, args.repeats))
    section("prompt_32k", lambda: prompt_section(shape, args.device, paths, args.prompt_repeats))
    if args.sweep and "kernel" in paths:
        section("layouts", lambda: layout_section(shape, args.device, args.repeats))
    return finish_run(result, args, deadline, table)


def table(result: dict) -> str:
    lines = [f"device {result['device']}, torch {result['torch']}, V {result['vocab']}, paths {'/'.join(result['paths'])}, "
             f"{result['elapsed_s']} s", "",
             "| what | torch ms | kernel ms | torch graph ms | kernel graph ms | max abs diff | ids equal | note |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in ("rows", "prompt_chunk", "prompt_32k"):
        value = result.get(name)
        if isinstance(value, dict) and ("error" in value or "skipped" in value):
            lines.append(f"| {name} | | | | | | | {(value.get('error') or value['skipped']).strip().splitlines()[-1][:120]} |")
    chunk = result.get("prompt_chunk")
    for row in [*section_rows(result, "rows"), *([chunk] if isinstance(chunk, dict) and "rows" in chunk else [])]:
        lines.append(f"| {row['rows']} rows {row['dtype']} k={row['k']} | {row.get('torch_ms', '')} | {row.get('kernel_ms', '')} | "
                     f"{row.get('torch_graph_ms') or ''} | {row.get('kernel_graph_ms') or ''} | {row.get('max_abs_diff', '')} | "
                     f"{row.get('ids_equal', '')} | {_per_kernel(row)} |")  # fmt: skip
    prompt = result.get("prompt_32k") or {}
    if "torch_ms" in prompt:
        extra = {path: prompt.get(f"{path}_extra_bytes") for path in PATHS}
        gib = ", ".join(f"{path} +{value / 2**30:.2f} GiB" for path, value in extra.items() if value is not None)
        lines.append(f"| prompt {prompt['rows']} rows k={prompt['k']} via LM head | {prompt['torch_ms']} | {prompt.get('kernel_ms', '')} | | | "
                     f"{prompt.get('max_abs_diff', '')} | {prompt.get('ids_equal', '')} | head alone {prompt['head_alone_ms']} ms; "
                     f"peak extra {gib or 'n/a'} |")  # fmt: skip
    for row in section_rows(result, "greedy"):
        for name in ("before", "after"):
            what = "argmax, then the kernels" if name == "before" else "the kernels taking the argmax"
            lines.append(f"| greedy {row['rows']} rows k={row['k']}: {what} | | {row[f'{name}_ms']} | | {row.get(f'{name}_graph_ms') or ''} | "
                         f"{row['max_abs_diff']} | {row['ids_equal']} | tokens equal {row['tokens_equal']}; "
                         f"{_per_kernel({'kernels_device_ms': row.get(f'{name}_kernels_device_ms')})} |")  # fmt: skip
    for row in section_rows(result, "layouts"):
        lines.append(f"| layout BLOCK {row['block']}, {row['target_programs']} programs ({row['splits']} splits): {row['rows']} rows "
                     f"{row['dtype']} k={row['k']} | | {row['kernel_ms']} | | {row.get('kernel_graph_ms') or ''} | {row['max_abs_diff']} | "
                     f"{row['ids_equal']} | {_per_kernel(row)} |")  # fmt: skip
    return "\n".join(lines)


def _per_kernel(row: dict) -> str:
    """"partial_lse 0.0025, candidates 0.018, ..." from a row's `kernels_device_ms`."""
    kernels = row.get("kernels_device_ms") or {}
    return ", ".join(f"{name.strip('_').removesuffix('_kernel')} {ms}" for name, ms in kernels.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_check_arguments(parser, tiny="V=1000, a few rows, a 40-row prompt", repeats=30, budget_s=60.0,
                        out="gpu_logprob_kernel.json", what="calls per row measurement")
    parser.add_argument("--prompt-repeats", type=int, default=3, help="timed whole-prompt calls per path (median)")
    parser.add_argument("--sweep", action="store_true", help="also time the kernels at other column tiles and split counts (`layouts`)")


def main(args: argparse.Namespace) -> int:
    result = run(args)
    mismatched = [name for name in ("rows", "greedy", "prompt_chunk", "prompt_32k", "layouts")
                  for row in (section_rows(result, name) or [result.get(name) or {}])
                  if row.get("ids_equal") is False or row.get("tokens_equal") is False]  # fmt: skip
    return 1 if failures(result) or mismatched else 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
