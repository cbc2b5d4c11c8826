"""Ragged attention on one GPU: the Triton varlen kernel (`triton_varlen.py`) against the SDPA
groups it replaces, alone and inside the real runner, both paths in the same run.

Sections, in this order, each in its own try/except (one failure keeps the rest); one that would
start more than --budget-s after the start is skipped:
- `kernels`: one attention layer of the Qwen3-8B shape (heads 32 / 8, d 128, bf16, the cache's
  16-token pages), per ragged mix: max abs error of the kernel against the SDPA groups, and ms of
  each (CUDA events, warm-up, median). Mixes: `mixed` (64 decodes at context 256 + one 128-token
  prefill), `prefills` (8 chunks of varied length, most with prior context), `long` (one
  32,768-token prompt in chunks of the scheduler's default budget, 2048; summed over its chunks,
  and x layers).
- `mixed_step`: `ModelRunner.forward` of the 8B shape (dummy weights) on a mixed step, SDPA groups
  then the kernel; references: the decode alone (graph replay, and eager) and the prefill alone.
  Hidden-state difference, next-token agreement and host syncs (torch's sync debug mode) per path.
- `ragged_graph`: the same mixed step, and a `compact`-like verify step (the decodes with ragged
  1..8-token queries), replayed from a ragged CUDA graph (`ragged_graphs.py`: padded to a (sequence
  rung, token rung, block_m) key, captured on first use) against the same step eager on the kernel
  path: ms, next-token agreement (argmax of every row's logits), hidden-state difference (and the
  worst row's), the same against the padded path run eagerly (same kernels and shapes: a capture
  bug shows there, apart from the bf16 noise padding the GEMMs adds against eager), host syncs, the first step's seconds (capture included), each key's capture seconds, and the device
  memory the graphs reserved. On CPU the padded twin runs eagerly (no capture).
- `prefill_32k`: `SchedulerCore`, one 32,768-token request (1 new token), without and with top-2
  prompt logprobs, each path: seconds, and peak device memory above the start (the logprobs'
  extra memory is the difference); and the kernel path once more at 4x the chunk budget; then
  top-2 at 1x, 4x and the whole prompt in one step with `ModelRunner.dense_prefill` on (path `kernel_dense`: the chunks'
  attention through SDPA, cuDNN first, `dense_attention.py`).
- `sweep`: the kernel's launch settings (tile rows, keys per iteration, warps, stages) on `mixed`
  and `long`, so the defaults can be set from one run.

    sparkwire bench gpu-kernels attention --out $OUT/gpu_attention.json
    sparkwire bench gpu-kernels attention --device cpu --tiny --out /tmp/attention.json  # smoke

On CPU there is no kernel: the "kernel" columns run its torch twin (`varlen_attention_torch`).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch

from contracts.scheduler import LogprobParams, SamplingParams
from ops.bench import scheduler_harness as harness
from ops.bench.common import (
    Shape, add_check_arguments, bench_dtype, check_shape, deadline_sections, device_name, finish_run, load_runner,
    median_ms, only, ragged_step, rounded, script, section_rows, sync_count, worst_row_rel_diff,
)  # fmt: skip
from services.scheduler.model.attention import paged_attention, plan_attention, plan_varlen
from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.dense_attention import DENSE_MIN_QUERY_LEN, DenseConfig
from services.scheduler.model.ragged_graphs import token_ladder
from services.scheduler.model.runner import ModelRunner, triton_available

TOP2 = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
PATHS = ("sdpa", "kernel")  # ModelRunner.ragged_kernel False, True


# (tile rows, keys per iteration, warps, stages); the first is the kernel's default at 128 rows
SWEEP = ((128, 64, 8, 3), (128, 64, 4, 2), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2))


# ---- inputs ----


def mixes(shape: Shape) -> dict[str, list[list[tuple[int, int]]]]:
    """Each mix as its steps, a step as (context, new tokens) per sequence."""
    mixed = [(shape.decode_context - 1, 1)] * shape.decodes + [(0, shape.prefill)]
    long = [[(start, min(shape.chunk, shape.long_prompt - start))] for start in range(0, shape.long_prompt, shape.chunk)]
    return {"mixed": [mixed], "prefills": [list(shape.prefills)], "long": long}


def layer_inputs(shape: Shape, steps: list[list[tuple[int, int]]], device: str, dtype: torch.dtype):
    """(key cache, value cache, [(query, batch)] per step) of random values; pages wide enough for every step."""
    width = -(-max(ctx + n for step in steps for ctx, n in step) // shape.page)
    num_seqs = max(len(step) for step in steps)
    gen = torch.Generator(device=device).manual_seed(0)
    caches = [torch.randn(num_seqs * width + 1, shape.page, shape.num_kv_heads, shape.head_dim, generator=gen, device=device,
                          dtype=dtype) for _ in range(2)]  # fmt: skip
    inputs = []
    for step in steps:
        batch = ragged_step(step, shape.page, width, device)
        query = torch.randn(batch.num_tokens, shape.num_heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
        inputs.append((query, batch))
    return caches, inputs


# ---- timing ----


def uses_kernel(device: str) -> bool:
    return device == "cuda" and triton_available()


# ---- sections ----


def kernel_rows(shape: Shape, device: str, dtype: torch.dtype, repeats: int) -> list[dict]:
    rows = []
    scale = shape.head_dim**-0.5
    group = shape.num_heads // shape.num_kv_heads
    for name, steps in mixes(shape).items():
        (key_cache, value_cache), inputs = layer_inputs(shape, steps, device, dtype)
        row = {"mix": name, "steps": len(steps), "tokens": sum(q.shape[0] for q, _ in inputs), "max_abs_err": 0.0,
               "ref_max_abs": 0.0, "sdpa_ms": 0.0, "kernel_ms": 0.0, "sdpa_plan_ms": 0.0, "kernel_plan_ms": 0.0}  # fmt: skip
        for query, batch in inputs:
            sdpa_plan = plan_attention(batch, shape.page)
            kernel_plan = plan_varlen(batch, group, use_kernel=uses_kernel(device))
            want = paged_attention(query, key_cache, value_cache, sdpa_plan, scale).float()
            got = paged_attention(query, key_cache, value_cache, kernel_plan, scale).float()
            row["max_abs_err"] = max(row["max_abs_err"], float((got - want).abs().max()))
            row["ref_max_abs"] = max(row["ref_max_abs"], float(want.abs().max()))
            row["sdpa_ms"] += median_ms(lambda: paged_attention(query, key_cache, value_cache, sdpa_plan, scale), device, repeats)
            row["kernel_ms"] += median_ms(lambda: paged_attention(query, key_cache, value_cache, kernel_plan, scale), device, repeats)
            row["sdpa_plan_ms"] += median_ms(lambda: plan_attention(batch, shape.page), device, repeats)
            row["kernel_plan_ms"] += median_ms(lambda: plan_varlen(batch, group), device, repeats)
        row["speedup"] = row["sdpa_ms"] / row["kernel_ms"] if row["kernel_ms"] else None
        row["x_layers_ms"] = {path: row[f"{path}_ms"] * shape.num_layers for path in PATHS}
        rows.append(rounded(row))
    return rows


def sweep_rows(shape: Shape, device: str, dtype: torch.dtype, repeats: int) -> list[dict]:
    """Each launch setting on the `mixed` and `long` mixes (kernel ms summed over a mix's steps)."""
    from services.scheduler.model.triton_varlen import LaunchConfig, varlen_attention_triton

    group = shape.num_heads // shape.num_kv_heads
    scale = shape.head_dim**-0.5
    rows = []
    for name in ("mixed", "long"):
        (key_cache, value_cache), inputs = layer_inputs(shape, mixes(shape)[name], device, dtype)
        for tile_rows, block_n, num_warps, num_stages in SWEEP:
            config = LaunchConfig(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
            row = {"mix": name, "tile_rows": tile_rows, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
            plans = [(query, plan_varlen(batch, group, max_rows=tile_rows)) for query, batch in inputs]

            def attend(query, plan):
                tensors = (plan.query_start_loc, plan.seq_lens, plan.block_tables, plan.tiles, plan.block_m)
                return varlen_attention_triton(query, key_cache, value_cache, *tensors, scale, config)

            try:
                row["kernel_ms"] = round(sum(median_ms(lambda: attend(q, p), device, repeats) for q, p in plans), 4)
            except Exception as exc:  # a setting the compiler refuses (shared memory) is a row, not a lost sweep
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
    return rows


def mixed_step(runner: ModelRunner, shape: Shape, repeats: int) -> dict:
    """The mixed step through `ModelRunner.forward` with the SDPA groups, then the kernel."""
    device = runner.device.type
    width = -(-max(shape.decode_context, shape.prefill) // shape.page)
    seqs = list(range(shape.decodes))
    runner.ragged_kernel = False  # the decodes' KV written by the known path, whatever the kernel does
    runner.forward(ragged_step([(0, shape.decode_context - 1)] * shape.decodes, shape.page, width, device, seqs))
    decode = ragged_step([(shape.decode_context - 1, 1)] * shape.decodes, shape.page, width, device, seqs)
    prefill = ragged_step([(0, shape.prefill)], shape.page, width, device, [shape.decodes])
    mixed = ragged_step([(shape.decode_context - 1, 1)] * shape.decodes + [(0, shape.prefill)], shape.page, width, device,
                        [*seqs, shape.decodes])  # fmt: skip
    result: dict = {"decodes": shape.decodes, "context": shape.decode_context, "prefill": shape.prefill}
    if runner.decode_kernel:
        runner.prepare_decode_graphs(ladder=(shape.decodes,), max_blocks_per_seq=width)
        result["decode_graph_ms"] = median_ms(lambda: runner.forward(decode), device, repeats)
        runner.drop_decode_graphs()
    result["decode_eager_ms"] = median_ms(lambda: runner.forward(decode), device, repeats)
    outputs = {}
    for path in _paths(runner):
        runner.ragged_kernel = path == "kernel"
        result[f"prefill_{path}_ms"] = median_ms(lambda: runner.forward(prefill), device, repeats)
        result[f"mixed_{path}_ms"] = median_ms(lambda: runner.forward(mixed), device, repeats)
        result[f"mixed_{path}_syncs"] = sync_count(lambda: runner.forward(mixed), device)
        outputs[path] = _hidden_and_next(runner, mixed)
    if len(outputs) == 2:
        (sdpa_hidden, sdpa_next), (kernel_hidden, kernel_next) = outputs["sdpa"], outputs["kernel"]
        result["hidden_max_abs_diff_relative"] = float((kernel_hidden - sdpa_hidden).abs().max() / sdpa_hidden.abs().max())
        result["next_token_agreement"] = float((kernel_next == sdpa_next).float().mean())
        result["speedup"] = result["mixed_sdpa_ms"] / result["mixed_kernel_ms"]
    return rounded(result)


def _paths(runner: ModelRunner) -> tuple[str, ...]:
    return PATHS if uses_kernel(runner.device.type) else ("sdpa",)


def _hidden_and_next(runner: ModelRunner, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states f32 [T, H], next token of each sequence [B])."""
    hidden = runner.forward(batch).hidden_states
    last = torch.tensor(np.cumsum(batch.host_query_lens) - 1, device=runner.device)
    return hidden.float(), runner.compute_logits(hidden[last]).argmax(-1)


def ragged_graph_steps(runner: ModelRunner, shape: Shape, repeats: int) -> dict:
    """The mixed step and a compact-like verify step, eager on the kernel path, then replayed from ragged graphs."""
    device = runner.device.type
    cuda = device == "cuda"
    width = -(-max(shape.decode_context + 8, shape.prefill) // shape.page)  # room for 8-token verify blocks
    seqs = list(range(shape.decodes))
    runner.ragged_kernel = False  # the decodes' KV written by the known path
    runner.forward(ragged_step([(0, shape.decode_context - 1)] * shape.decodes, shape.page, width, device, seqs))
    context = shape.decode_context - 1
    steps = {
        "mixed": ragged_step([(context, 1)] * shape.decodes + [(0, shape.prefill)], shape.page, width, device, [*seqs, shape.decodes]),
        "verify": ragged_step([(context, 1 + b % 8) for b in seqs], shape.page, width, device, seqs),
    }  # fmt: skip
    runner.ragged_kernel = uses_kernel(device)
    result: dict = {"token_ladder": list(token_ladder(shape.chunk))}
    eager, padded = {}, {}
    for name, batch in steps.items():
        result[f"{name}_tokens"] = batch.num_tokens
        result[f"{name}_eager_ms"] = median_ms(lambda: runner.forward(batch), device, repeats)
        eager[name] = _hidden_and_argmax(runner, batch)
    # The padded path run eagerly: the graphs' own reference (same kernels, same shapes), so a capture
    # bug shows as a difference here, apart from the bf16 noise that padding the GEMMs adds against eager.
    runner.prepare_ragged_graphs(token_ladder=token_ladder(shape.chunk), max_blocks_per_seq=width, capture=False)
    for name, batch in steps.items():
        result[f"{name}_padded_eager_ms"] = median_ms(lambda: runner.forward(batch), device, repeats)
        padded[name] = _hidden_and_argmax(runner, batch)
    runner.drop_ragged_graphs()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # so the difference below is the graphs' pool and buffers, not the cache's growth
    reserved = torch.cuda.memory_reserved() if cuda else 0
    runner.prepare_ragged_graphs(token_ladder=token_ladder(shape.chunk), max_blocks_per_seq=width)  # captures on CUDA
    try:
        for name, batch in steps.items():
            start = time.perf_counter()
            runner.forward(batch)  # first use of its key: the capture
            if cuda:
                torch.cuda.synchronize()
            result[f"{name}_first_step_s"] = round(time.perf_counter() - start, 4)
            result[f"{name}_graph_ms"] = median_ms(lambda: runner.forward(batch), device, repeats)
            result[f"{name}_graph_syncs"] = sync_count(lambda: runner.forward(batch), device)
            hidden, argmax = _hidden_and_argmax(runner, batch)
            result[f"{name}_hidden_max_abs_diff_relative"] = float((hidden - eager[name][0]).abs().max() / eager[name][0].abs().max())
            result[f"{name}_argmax_agreement"] = float((argmax == eager[name][1]).float().mean())
            result[f"{name}_worst_row_rel_diff"] = worst_row_rel_diff(hidden, eager[name][0])
            result[f"{name}_vs_padded_max_abs_diff"] = float((hidden - padded[name][0]).abs().max())
            result[f"{name}_vs_padded_argmax_agreement"] = float((argmax == padded[name][1]).float().mean())
            result[f"{name}_speedup"] = result[f"{name}_eager_ms"] / result[f"{name}_graph_ms"]
        graphs = runner.ragged_graphs
        result["captured"] = [{**dataclasses.asdict(key), "capture_s": round(graphs.capture_seconds[key], 3)} for key in graphs.graphs]
        result["capture_failed"] = [dataclasses.asdict(key) for key in graphs.failed]  # see the log's warning
        if cuda:
            torch.cuda.empty_cache()  # what stays reserved: the graphs' private pool and the static buffers
        result["graphs_reserved_mib"] = round((torch.cuda.memory_reserved() - reserved) / 2**20, 1) if cuda else None
    finally:
        runner.drop_ragged_graphs()
    return rounded(result)


def _hidden_and_argmax(runner: ModelRunner, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states f32 [T, H], argmax of every row's logits [T]), copied out of any graph's buffers."""
    hidden = runner.forward(batch).hidden_states  # rows of the graphs' shared output buffer: the next step overwrites them
    return hidden.to(torch.float32, copy=True), runner.compute_logits(hidden).argmax(-1)


def prefill_rows(runner: ModelRunner, shape: Shape) -> list[dict]:
    """One long prompt through the core, chunked by the policy, without and with top-2 prompt
    logprobs; then, on the kernel path, top-2 at 4x the chunk (what a larger budget would buy)."""
    prompt = np.random.default_rng(0).integers(0, runner.config.vocab_size, shape.long_prompt, dtype=np.int32)
    rows = []
    for path in _paths(runner):
        runner.ragged_kernel = path == "kernel"
        _prefill(runner, shape.chunk, prompt[: 2 * shape.chunk], TOP2)  # warm-up: kernels compiled, allocator grown
        plain, top2 = (_prefill(runner, shape.chunk, prompt, logprobs) for logprobs in (LogprobParams(), TOP2))
        if plain["peak_extra_mib"] is not None:
            top2["logprobs_extra_mib"] = round(top2["peak_extra_mib"] - plain["peak_extra_mib"], 1)
        rows += [{"path": path, "logprobs": "plain", **plain}, {"path": path, "logprobs": "top2", **top2}]
    if runner.ragged_kernel:
        for chunk in (4 * shape.chunk, shape.long_prompt):  # 4x the budget; the whole prompt in one step
            rows.append({"path": "kernel", "logprobs": "top2", **_prefill(runner, chunk, prompt, TOP2)})
        rows += dense_prefill_rows(runner, shape, prompt)
    return rows


def dense_prefill_rows(runner: ModelRunner, shape: Shape, prompt: np.ndarray) -> list[dict]:
    """Top-2 at 1x and 4x the chunk and in one step with the dense path on (threshold lowered to the tiny chunk)."""
    runner.dense_prefill = DenseConfig(min_query_len=min(DENSE_MIN_QUERY_LEN, shape.chunk))
    try:
        _prefill(runner, shape.chunk, prompt[: 2 * shape.chunk], TOP2)  # warm-up: cuDNN plans built
        chunks = (shape.chunk, 4 * shape.chunk, shape.long_prompt)
        return [{"path": "kernel_dense", "logprobs": "top2", **_prefill(runner, c, prompt, TOP2)} for c in chunks]
    finally:
        runner.dense_prefill = None


def _prefill(runner: ModelRunner, chunk: int, prompt: np.ndarray, logprobs: LogprobParams) -> dict:
    cuda = runner.device.type == "cuda"
    core = harness.core_for(runner, max_running_requests=1, chunked_prefill_size=chunk)  # fused logprob kernels where they run
    sampling = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    core.add(harness.new_request("long", prompt, sampling, logprobs))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    start, steps, rows = time.perf_counter(), 0, 0
    while core.has_work():
        for output in core.step():
            rows += harness.prompt_logprob_rows(output)
        steps += 1
    if cuda:
        torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return {"prompt": len(prompt), "chunk": chunk, "seconds": round(time.perf_counter() - start, 4), "steps": steps,
            "prompt_logprob_rows": rows, "peak_extra_mib": peak and round(peak, 1)}  # fmt: skip


# ---- the run ----


def run(args: argparse.Namespace) -> dict:
    shape = check_shape(args.tiny)
    dtype = bench_dtype(args.device)
    deadline = time.monotonic() + args.budget_s
    result: dict = {"device": device_name(args.device), "torch": torch.__version__,
                    "shape": {k: str(v) for k, v in dataclasses.asdict(shape).items()}, "kernel": uses_kernel(args.device)}  # fmt: skip
    section = only(args.sections, deadline_sections(result, deadline))
    section("kernels", lambda: kernel_rows(shape, args.device, dtype, args.repeats))
    runners: list[ModelRunner] = []
    section("runner", lambda: _load(shape, args.device, dtype, runners))
    for runner in runners:
        section("mixed_step", lambda: mixed_step(runner, shape, args.repeats))
        section("ragged_graph", lambda: ragged_graph_steps(runner, shape, args.repeats))
        section("prefill_32k", lambda: prefill_rows(runner, shape))
    if uses_kernel(args.device):  # last: settings for the next round, the least needed now
        section("sweep", lambda: sweep_rows(shape, args.device, dtype, max(3, args.repeats // 2)))
    return finish_run(result, args, deadline, table)


def _load(shape: Shape, device: str, dtype: torch.dtype, into: list[ModelRunner]) -> dict:
    if device == "cuda":
        torch.cuda.empty_cache()  # the KV budget is a fraction of the free memory: not of what the kernels section left cached
    start = time.perf_counter()
    into.append(load_runner(shape, device, dtype))
    return {"model": shape.model.name, "load_s": round(time.perf_counter() - start, 1)}


def table(result: dict) -> str:
    lines = [f"device {result['device']}, torch {result['torch']}, kernel {'Triton' if result['kernel'] else 'torch twin'}, "
             f"{result['elapsed_s']} s", "", "| what | sdpa ms | kernel ms | speedup | note |", "|---|---|---|---|---|"]  # fmt: skip
    for name in ("kernels", "runner", "mixed_step", "ragged_graph", "prefill_32k", "sweep"):
        value = result.get(name)
        if isinstance(value, dict) and ("error" in value or "skipped" in value):
            lines.append(f"| {name} | | | | {(value.get('error') or value['skipped']).strip().splitlines()[-1][:120]} |")
    for r in section_rows(result, "kernels"):
        lines.append(f"| layer, {r['mix']} ({r['tokens']} tok, {r['steps']} steps) | {r['sdpa_ms']} | {r['kernel_ms']} | "
                     f"{r['speedup'] and round(r['speedup'], 2)} | max abs err {r['max_abs_err']:.2e} (ref max {r['ref_max_abs']:.2f}); "
                     f"x{result['shape']['num_layers']} layers: {r['x_layers_ms']['sdpa']:.0f} / {r['x_layers_ms']['kernel']:.0f} ms |")  # fmt: skip
    for r in section_rows(result, "sweep"):
        lines.append(f"| sweep {r['mix']} rows {r['tile_rows']} n {r['block_n']} w {r['num_warps']} s {r['num_stages']} | | "
                     f"{r.get('kernel_ms', '')} | | {r.get('error', '')[:80]} |")  # fmt: skip
    step = result.get("mixed_step") or {}
    if "mixed_sdpa_ms" in step:
        lines.append(f"| runner mixed step ({step['decodes']} decodes + {step['prefill']}) | {step['mixed_sdpa_ms']} | "
                     f"{step.get('mixed_kernel_ms', '')} | {step.get('speedup', '')} | decode graph {step.get('decode_graph_ms')} / "
                     f"eager {step['decode_eager_ms']} ms; prefill alone {step['prefill_sdpa_ms']} / {step.get('prefill_kernel_ms')} ms; "
                     f"next tokens agree {step.get('next_token_agreement')}; host syncs {step.get('mixed_sdpa_syncs')} / "
                     f"{step.get('mixed_kernel_syncs')} |")  # fmt: skip
    graph = result.get("ragged_graph") or {}
    for name in ("mixed", "verify"):
        if f"{name}_graph_ms" in graph:
            lines.append(f"| ragged graph, {name} step ({graph[f'{name}_tokens']} tok) | | {graph[f'{name}_eager_ms']} eager / "
                         f"{graph[f'{name}_graph_ms']} graph | {graph[f'{name}_speedup']} | argmax agree {graph[f'{name}_argmax_agreement']}; "
                         f"rel hidden diff {graph[f'{name}_hidden_max_abs_diff_relative']:.2e} (worst row "
                         f"{graph[f'{name}_worst_row_rel_diff']:.2e}); vs padded eager {graph[f'{name}_padded_eager_ms']} ms: "
                         f"max abs diff {graph[f'{name}_vs_padded_max_abs_diff']:.2e}, argmax agree "
                         f"{graph[f'{name}_vs_padded_argmax_agreement']}; syncs {graph[f'{name}_graph_syncs']}; "
                         f"first step {graph[f'{name}_first_step_s']} s |")  # fmt: skip
    if "captured" in graph:
        keys = ", ".join(f"({k['num_seqs']}, {k['num_tokens']}, {k['block_m']}) {k['capture_s']} s" for k in graph["captured"])
        lines.append(f"| ragged graph captures | | | | {keys or 'none (CPU twin)'}; reserved +{graph['graphs_reserved_mib']} MiB; "
                     f"failed {len(graph['capture_failed'])} |")
    for r in section_rows(result, "prefill_32k"):
        lines.append(f"| prefill {r['prompt']} tok in {r['chunk']}-token chunks, {r['path']}, {r['logprobs']} | {r['seconds'] if r['path'] == 'sdpa' else ''} | "
                     f"{r['seconds'] if r['path'] != 'sdpa' else ''} | | {r['steps']} steps, peak +{r['peak_extra_mib']} MiB, "
                     f"{r['prompt_logprob_rows']} prompt rows" + (f", logprobs +{r['logprobs_extra_mib']} MiB" if "logprobs_extra_mib" in r else "")
                     + " |")  # fmt: skip
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_check_arguments(parser, tiny="the tiny random model's shape and short mixes", repeats=10, budget_s=120.0,
                        out="gpu_attention.json")  # the longest section takes ~20 s
    parser.add_argument("--sections", nargs="*", default=None,
                        help="run only these (kernels, mixed_step, ragged_graph, prefill_32k, sweep; default all)")


def main(args: argparse.Namespace) -> int:
    result = run(args)
    failed = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]  # a sweep setting's error is a row
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
