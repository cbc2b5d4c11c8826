"""The fused small-op kernels (`triton_fused.py`, issue 12) on one GPU: the Qwen3-8B shape (dummy
bf16 weights) with `ModelRunner.fused_kernels` off and on, one runner built once, both in one run.

Sections, in this order, each in its own try/except (one failure keeps the rest); one that would
start more than --budget-s after the start is skipped:
- `prefill`: the context every decode below reads (--batches' largest number of sequences, each of
  --context - 1 tokens) as one ragged step, off then on (each rewrites the same K/V): argmax
  agreement of each sequence's last row, max |diff| / max |off| of the hidden states, worst row.
- `agreement`: per batch size, one eager decode step (position --context - 1) off then on, on the
  same cache (each writes the step's own K/V, then attends to it): next-token argmax agreement,
  relative hidden difference (max and worst row), and that of the K/V each wrote; as the scale of
  bf16 noise, per setting, sequence 0's hidden state in the smallest batch against the largest.
- `graph_decode`: per setting, decode graphs captured for the batch sizes alone (dropped and captured
  again between settings); per batch: ms of one replay (CUDA events, median of --repeats, each
  from an idle device) and the replay's next tokens against the eager step's. On CPU there is no
  capture: the padded eager twin runs, timed by the host clock.
- `profile`: the eager batch-1 decode step under torch.profiler, off and on: device kernels per step
  and the top --top of the unfused step by device time.

    sparkwire bench gpu-kernels fused --out $OUT/gpu_fused.json
    sparkwire bench gpu-kernels fused --device cpu --tiny --out /tmp/fused.json  # smoke, off only
    TRITON_INTERPRET=1 python ops/bench/gpu_fused_check.py --device cpu --tiny --out /tmp/fused.json

On CPU the fused kernels run only in Triton's interpreter (TRITON_INTERPRET=1); elsewhere the
"on" setting is left out.
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
    MODEL_CONFIGS, add_check_arguments, bench_dtype, deadline_sections, device_name, failures, finish_run, median_ms, next_tokens,
    ragged_step, rounded, script, section_rows, self_us, worst_row_rel_diff,
)  # fmt: skip
from services.models import RANDOM_TINY_MODEL
from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.loader import load_model_runner
from services.scheduler.model.runner import ModelRunner, triton_available

SETTINGS = {"off": False, "on": True}  # ModelRunner.fused_kernels


@dataclass(frozen=True)
class Shape:
    model: Path
    batches: tuple[int, ...]  # decode batch sizes; each a rung of its own decode graphs
    context: int  # seq_len of each decode step (the context + the step's token)
    page: int  # the cache's block size


FULL = Shape(MODEL_CONFIGS / "Qwen3-8B", (1, 64), 256, 16)
TINY = Shape(RANDOM_TINY_MODEL, (1, 3), 20, 4)


def settings_here(device: str) -> tuple[str, ...]:
    """"off", and "on" where the fused kernels run: CUDA with Triton, or Triton's CPU interpreter."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return ("off", "on") if triton_available() and (device == "cuda" or interpreted) else ("off",)


def context_step(shape: Shape, device: str) -> ForwardBatch:
    """The prefill of every sequence's context: positions 0 .. context - 2; sequence s owns pages s * width ..."""
    return ragged_step([(0, shape.context - 1)] * max(shape.batches), shape.page, _width(shape), device)


def decode_step(shape: Shape, batch: int, device: str) -> ForwardBatch:
    """One token per sequence 0 .. batch - 1, at position context - 1: the first rows of the largest
    batch's step, so sequence 0 has the same token in every batch size."""
    step = ragged_step([(shape.context - 1, 1)] * max(shape.batches), shape.page, _width(shape), device)
    per_sequence = ("input_ids", "positions", "seq_lens", "block_tables", "slot_mapping", "host_query_lens", "host_seq_lens")
    rows = {name: getattr(step, name)[:batch] for name in per_sequence}  # one token per sequence
    return dataclasses.replace(step, query_start_loc=step.query_start_loc[: batch + 1], **rows)


def _width(shape: Shape) -> int:
    return -(-shape.context // shape.page)


def relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def written_kv(runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
    """Every layer's K and V at the batch's slots, [L, 2, T, Hkv, D] (a copy)."""
    kv = runner.kv_cache.kv
    return kv.flatten(2, 3)[:, :, batch.slot_mapping.long()].clone()


def forward_with(runner: ModelRunner, setting: str, batch: ForwardBatch) -> torch.Tensor:
    runner.fused_kernels = SETTINGS[setting]
    return runner.forward(batch).hidden_states.float()  # [T, H], copied out of any graph buffer


# ---- sections ----


def prefill_rows(runner: ModelRunner, shape: Shape, settings: tuple[str, ...]) -> dict:
    step = context_step(shape, runner.device.type)
    last = torch.arange(1, max(shape.batches) + 1, device=runner.device) * (shape.context - 1) - 1  # each sequence's last row
    hidden = {setting: forward_with(runner, setting, step) for setting in settings}
    result: dict = {"sequences": max(shape.batches), "context": shape.context - 1, "tokens": step.num_tokens}
    if "on" in hidden:
        off, on = hidden["off"], hidden["on"]
        result["argmax_agreement"] = float((next_tokens(runner, on[last]) == next_tokens(runner, off[last])).float().mean())
        result["hidden_rel_diff"] = relative_diff(on, off)
        result["worst_row_rel_diff"] = worst_row_rel_diff(on, off)
    return rounded(result)


def agreement_rows(runner: ModelRunner, shape: Shape, settings: tuple[str, ...]) -> list[dict]:
    """Per batch size, off against on; and, as the scale of bf16 noise, sequence 0's hidden state in
    the smallest batch against the largest (same inputs, other GEMM shapes), per setting."""
    rows, first_rows = [], {}
    for size in shape.batches:
        batch = decode_step(shape, size, runner.device.type)
        outputs = {}
        for setting in settings:
            hidden = forward_with(runner, setting, batch)
            outputs[setting] = (hidden, next_tokens(runner, hidden), written_kv(runner, batch))
            first_rows.setdefault(setting, []).append(hidden[:1])
        row: dict = {"batch": size, "context": shape.context}
        if "on" in outputs:
            (off, off_next, off_kv), (on, on_next, on_kv) = outputs["off"], outputs["on"]
            row["argmax_agreement"] = float((on_next == off_next).float().mean())
            row["hidden_rel_diff"] = relative_diff(on, off)
            row["worst_row_rel_diff"] = worst_row_rel_diff(on, off)
            row["kv_rel_diff"] = relative_diff(on_kv, off_kv)
        rows.append(rounded(row))
    noise = {f"{setting}_seq0_smallest_vs_largest_batch_rel_diff": relative_diff(first[0], first[-1])
             for setting, first in first_rows.items()}  # fmt: skip
    return [*rows, rounded({"batch": "noise", **noise})]


def graph_rows(runner: ModelRunner, shape: Shape, settings: tuple[str, ...], repeats: int) -> list[dict]:
    """Per setting, its rows, or one row with the error (a failing "on" keeps the "off" baseline)."""
    rows = []
    for setting in settings:
        try:
            rows += _graph_rows(runner, shape, setting, repeats)
        except Exception:
            rows.append({"fused": setting, "error": traceback.format_exc()[-2000:]})
    return rows


def _graph_rows(runner: ModelRunner, shape: Shape, setting: str, repeats: int) -> list[dict]:
    device = runner.device.type
    runner.fused_kernels = SETTINGS[setting]
    rows = []
    try:
        runner.prepare_decode_graphs(ladder=shape.batches, max_blocks_per_seq=_width(shape))  # captures on CUDA
        for size in shape.batches:
            batch = decode_step(shape, size, device)
            eager = next_tokens(runner, _eager(runner, batch))
            replayed = next_tokens(runner, runner.forward(batch).hidden_states)  # loads the static buffers
            graph = runner.decode_graphs.graphs.get((size, 1))
            step = graph.replay if graph is not None else lambda: runner.forward(batch)
            rows.append({"fused": setting, "batch": size, "captured": graph is not None,
                         "step_ms": median_ms(step, device, repeats),
                         "tokens_agree_with_eager": float((replayed == eager).float().mean())})  # fmt: skip
    finally:
        runner.drop_decode_graphs()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the graphs' pool, before the next setting captures its own
    return rows


def _eager(runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
    graphs, runner.decode_graphs = runner.decode_graphs, None
    try:
        return runner.forward(batch).hidden_states.float()
    finally:
        runner.decode_graphs = graphs


def profile_rows(runner: ModelRunner, shape: Shape, settings: tuple[str, ...], top: int) -> dict:
    """Kernels of one eager batch-1 decode step per setting, and the unfused step's top kernels by device time."""
    from torch.profiler import ProfilerActivity

    cuda = runner.device.type == "cuda"
    batch = decode_step(shape, 1, runner.device.type)
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    result: dict = {"unit": "device kernels" if cuda else "cpu ops (no device here)"}
    for setting in settings:
        try:
            result.update(_profile(runner, setting, batch, activities, top))
        except Exception:
            result[f"{setting}_error"] = traceback.format_exc()[-2000:]
    return result


def _profile(runner: ModelRunner, setting: str, batch: ForwardBatch, activities: list, top: int) -> dict:
    from torch.profiler import profile

    cuda = runner.device.type == "cuda"
    if cuda:  # warm: compiled, allocator grown (the CPU has neither, and the sections before ran this step)
        forward_with(runner, setting, batch)
    with profile(activities=activities) as prof:
        forward_with(runner, setting, batch)
        if cuda:
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if self_us(e, cuda) > 0]
    result = {f"{setting}_kernels_per_step": sum(e.count for e in events),
              f"{setting}_device_ms": round(sum(self_us(e, cuda) for e in events) / 1e3, 4)}  # fmt: skip
    if setting == "off":
        events.sort(key=lambda e: self_us(e, cuda), reverse=True)
        result["off_top"] = [{"name": e.key[:90], "count": e.count, "ms": round(self_us(e, cuda) / 1e3, 4)} for e in events[:top]]
    return result


# ---- the run ----


def run(args: argparse.Namespace) -> dict:
    shape = TINY if args.tiny else FULL
    if args.model is not None:  # another shape at the same batches and context (e.g. Qwen3-0.6B: issue 12 asks <= 1.5 ms)
        shape = dataclasses.replace(shape, model=args.model)
    dtype = bench_dtype(args.device)
    settings = settings_here(args.device)
    deadline = time.monotonic() + args.budget_s
    result: dict = {"device": device_name(args.device), "torch": torch.__version__,
                    "model": shape.model.name, "dtype": str(dtype), "settings": list(settings)}  # fmt: skip
    section = deadline_sections(result, deadline)
    runners: list[ModelRunner] = []
    section("runner", lambda: _load(shape, args.device, dtype, runners))
    for runner in runners:
        section("prefill", lambda: prefill_rows(runner, shape, settings))
        section("agreement", lambda: agreement_rows(runner, shape, settings))
        section("graph_decode", lambda: graph_rows(runner, shape, settings, args.repeats))
        section("profile", lambda: profile_rows(runner, shape, settings, args.top))
    return finish_run(result, args, deadline, table)


def _load(shape: Shape, device: str, dtype: torch.dtype, into: list[ModelRunner]) -> dict:
    start = time.perf_counter()
    runner = load_model_runner(shape.model, device=device, dtype=dtype, load_format="dummy", kv_block_size=shape.page,
                               cuda_graphs=False)  # fmt: skip
    into.append(runner)
    return {"load_s": round(time.perf_counter() - start, 1), "num_blocks": runner.num_blocks}


def table(result: dict) -> str:
    lines = [f"device {result['device']}, torch {result['torch']}, {result['model']} {result['dtype']}, fused settings "
             f"{'/'.join(result['settings'])}, {result['elapsed_s']} s", "",
             "| what | off | on | agreement | note |", "|---|---|---|---|---|"]  # fmt: skip
    for name in ("runner", "prefill", "agreement", "graph_decode", "profile"):
        value = result.get(name)
        if isinstance(value, dict) and ("error" in value or "skipped" in value):
            lines.append(f"| {name} | | | | {(value.get('error') or value['skipped']).strip().splitlines()[-1][:120]} |")
    prefill = result.get("prefill") or {}
    if "tokens" in prefill:
        lines.append(f"| prefill {prefill['sequences']} x {prefill['context']} tok | | | "
                     f"{prefill.get('argmax_agreement', '')} | rel hidden diff {prefill.get('hidden_rel_diff', '')}, "
                     f"worst row {prefill.get('worst_row_rel_diff', '')} |")  # fmt: skip
    for row in section_rows(result, "agreement"):
        if row["batch"] == "noise":
            lines.append(f"| noise scale: seq 0 in b{shape_batches(result)} (same inputs, other GEMM shapes) | | | | " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "batch") + " |")
            continue
        lines.append(f"| eager decode b{row['batch']} ctx {row['context']} | | | {row.get('argmax_agreement', '')} | rel hidden diff "
                     f"{row.get('hidden_rel_diff', '')}, worst row {row.get('worst_row_rel_diff', '')}, kv {row.get('kv_rel_diff', '')} |")  # fmt: skip
    for row in section_rows(result, "graph_decode"):
        if "error" in row:
            lines.append(f"| graph decode, fused {row['fused']} | | | | {row['error'].strip().splitlines()[-1][:120]} |")
    graphs = {(row["fused"], row["batch"]): row for row in section_rows(result, "graph_decode") if "error" not in row}
    for size in sorted({batch for _, batch in graphs}):
        off, on = graphs.get(("off", size), {}), graphs.get(("on", size), {})
        lines.append(f"| {'graph' if off.get('captured') else 'padded eager'} decode step b{size} ms | {off.get('step_ms', '')} | "
                     f"{on.get('step_ms', '')} | {off.get('tokens_agree_with_eager', '')} / {on.get('tokens_agree_with_eager', '')} | "
                     "replay's tokens vs the eager step's, off / on |")  # fmt: skip
    profile = result.get("profile") or {}
    for setting in SETTINGS:
        if f"{setting}_error" in profile:
            lines.append(f"| profile, fused {setting} | | | | {profile[f'{setting}_error'].strip().splitlines()[-1][:120]} |")
    if "off_kernels_per_step" in profile:
        top = "; ".join(f"{e['name'][:40]} x{e['count']} {e['ms']} ms" for e in profile["off_top"][:5])
        lines.append(f"| eager b1 step, {profile['unit']} | {profile['off_kernels_per_step']} ({profile['off_device_ms']} ms) | "
                     f"{profile.get('on_kernels_per_step', '')} ({profile.get('on_device_ms', '')} ms) | | top off: {top} |")  # fmt: skip
    return "\n".join(lines)


def shape_batches(result: dict) -> str:
    sizes = [row["batch"] for row in section_rows(result, "agreement") if row["batch"] != "noise"]
    return f"{sizes[0]} vs b{sizes[-1]}" if sizes else ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_check_arguments(parser, tiny="the tiny random model, batches 1 and 3 at context 20", repeats=30, budget_s=60.0,
                        out="gpu_fused.json", model=True, what="replays per measurement")
    parser.add_argument("--top", type=int, default=12, help="kernels listed from the profile")


def main(args: argparse.Namespace) -> int:
    return 1 if failures(run(args)) else 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
