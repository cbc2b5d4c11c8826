"""The one-token GEMV kernels (`triton_fused.norm_gemv_triton`, `silu_gemv_triton`, `gemv_triton`:
issue 12, point 2) on one GPU, against what they replace: the fused small op then cuBLAS's matmul
(two launches), or cuBLAS's matmul alone (o_proj).

Sections, each in its own try/except; one that would start more than --budget-s after the start
is skipped:
- `kernels`: per model shape (--models) and op (norm + q/k/v, norm + gate/up, SiLU * up + down,
  o_proj), µs per call of what served before and of the GEMV at each tile setting (TILES, TINY_TILES with
  --tiny; `gemv_tiles`' own marked), as the median of --repeats replays of a CUDA graph of --calls calls; GB/s of the weight
  read; the largest |diff| against what served before, over that output's largest |value|.
- `steps`: per model, the batch-1 decode step through `ModelRunner` with the fused kernels on (its
  decode graphs captured, context 256; 20 with --tiny): ms of one replay with the GEMVs off
  (`llama.GEMV_TOKENS` set to 0 for the row: the step as it was), on, and on with each op's fastest tiles of `kernels`;
  each replay's next token against the eager GEMV-off step's; device kernels in one eager step,
  their device time, and those that take the most.

    sparkwire bench gpu-kernels gemv --out $OUT/gpu_gemv.json
    TRITON_INTERPRET=1 python ops/bench/gpu_gemv_check.py --device cpu --tiny --out /tmp/gemv.json  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ops.bench.common import (
    MODEL_CONFIGS, add_check_arguments, bench_dtype, deadline_sections, device_name, finish_run, graph_us, median_ms, next_tokens,
    ragged_step, script, self_us,
)  # fmt: skip
from services.models import RANDOM_TINY_MODEL
from services.scheduler.model import llama
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.loader import load_model_runner
from services.scheduler.model.runner import ModelRunner

MODELS = (MODEL_CONFIGS / "Qwen3-0.6B", MODEL_CONFIGS / "Qwen3-8B")
TILES = ((4, 256, 4), (4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 4), (32, 256, 4), (8, 1024, 8),
         (16, 1024, 8), (32, 512, 8))  # (BLOCK_N, BLOCK_K, warps)  # fmt: skip
OPS = ("norm_qkv", "norm_gate_up", "silu_down", "o_proj")
CONTEXT, PAGE = 256, 16
# --tiny: two tile settings of few programs, and a short context. In Triton's interpreter the cost is
# per program and BLOCK_K step: one call of the tiny model's gate/up GEMV took 2.8 s at 8 x 16 tiles,
# 0.12 s at 64 x 64; the context's prefill 10.7 s at 255 tokens, 0.9 s at 19 (2-core CPU box).
TINY_TILES, TINY_CONTEXT = ((32, 128, 4), (64, 64, 4)), 20


def op_inputs(config: ModelConfig, op: str, device: torch.device, dtype: torch.dtype) -> dict:
    """Random inputs of one op at this model's shape: the weight [N, K] and the one-token rows."""
    gen = torch.Generator(device=device).manual_seed(len(op))
    hidden, q_size, kv_size = config.hidden_size, config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    out_features, in_features = {"norm_qkv": (q_size + 2 * kv_size, hidden), "norm_gate_up": (2 * config.intermediate_size, hidden),
                                 "silu_down": (hidden, config.intermediate_size), "o_proj": (hidden, q_size)}[op]  # fmt: skip
    rand = lambda *shape, scale=1.0: scale * torch.randn(*shape, generator=gen, device=device, dtype=dtype)  # noqa: E731
    return {"weight": rand(out_features, in_features, scale=in_features**-0.5), "x": rand(1, hidden), "residual": rand(1, hidden),
            "attended": rand(1, q_size),
            "norm_weight": 1.0 + rand(hidden, scale=0.2), "gate_up": rand(1, 2 * config.intermediate_size, scale=3.0),
            "eps": config.rms_norm_eps}  # fmt: skip


def op_calls(op: str, inputs: dict):
    """(the launches as served before, the GEMV at given tiles) for one op."""
    from services.scheduler.model.triton_fused import add_rms_norm_triton, gemv_triton, norm_gemv_triton, silu_gemv_triton, silu_mul_triton

    x, residual, weight, norm_weight, eps = inputs["x"], inputs["residual"], inputs["weight"], inputs["norm_weight"], inputs["eps"]
    if op == "o_proj":
        return (lambda: F.linear(inputs["attended"], weight), lambda tiles: gemv_triton(inputs["attended"], weight, None, tiles))
    if op == "silu_down":
        return (lambda: F.linear(silu_mul_triton(inputs["gate_up"]), weight),
                lambda tiles: silu_gemv_triton(inputs["gate_up"], weight, None, tiles))  # fmt: skip
    return (lambda: F.linear(add_rms_norm_triton(x, residual, norm_weight, eps)[0], weight),
            lambda tiles: norm_gemv_triton(x, residual, norm_weight, eps, weight, None, tiles)[0])  # fmt: skip


def kernel_rows(model: Path, tiles: tuple[tuple[int, int, int], ...], device: torch.device, dtype: torch.dtype,
                args: argparse.Namespace) -> list[dict]:  # fmt: skip
    from services.scheduler.model.triton_fused import gemv_tiles

    config = ModelConfig.from_pretrained(model)
    rows = []
    for op in OPS:
        inputs = op_inputs(config, op, device, dtype)
        separate, gemv = op_calls(op, inputs)
        want = separate().float()
        weight_bytes = inputs["weight"].numel() * inputs["weight"].element_size()
        base = {"model": model.name, "op": op, "weight": list(inputs["weight"].shape)}
        us = graph_us(separate, device, args.calls, args.repeats)
        rows.append({**base, "path": "cuBLAS (after the norm or silu kernel)", "us": us, "gb_per_s": round(weight_bytes / us / 1e3, 1)})
        own = gemv_tiles(*inputs["weight"].shape, normed=op.startswith("norm"))
        for tile in dict.fromkeys((own, *tiles)):
            got = gemv(tile).float()
            us = graph_us(lambda t=tile: gemv(t), device, args.calls, args.repeats)
            rows.append({**base, "path": "gemv", "tiles": list(tile), "default": tile == own, "us": us,
                         "gb_per_s": round(weight_bytes / us / 1e3, 1),
                         "rel_diff": float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))})  # fmt: skip
    return rows


def fastest_tiles(rows: list[dict], model: str) -> dict[tuple[int, int], tuple[int, int, int]]:
    """Weight shape -> the GEMV tiles that ran it fastest in `kernels`."""
    best: dict[tuple[int, int], dict] = {}
    for row in rows:
        shape = tuple(row["weight"])
        if row["model"] == model and row["path"] == "gemv" and (shape not in best or row["us"] < best[shape]["us"]):
            best[shape] = row
    return {shape: tuple(row["tiles"]) for shape, row in best.items()}


@contextlib.contextmanager
def gemv_setting(setting: str, tuned: dict[tuple[int, int], tuple[int, int, int]]):
    """"off": no GEMVs (the step as it was); "on": `gemv_tiles`' own; "tuned": each shape's fastest."""
    from services.scheduler.model import triton_fused

    saved = llama.GEMV_TOKENS, triton_fused.gemv_tiles
    if setting == "off":
        llama.GEMV_TOKENS = 0
    if setting == "tuned":
        triton_fused.gemv_tiles = lambda n, k, normed: tuned.get((n, k)) or saved[1](n, k, normed)
    try:
        yield
    finally:
        llama.GEMV_TOKENS, triton_fused.gemv_tiles = saved


@torch.inference_mode()
def step_rows(model: Path, tuned: dict, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> list[dict]:
    runner = load_model_runner(model, device=device.type, dtype=dtype, load_format="dummy", kv_block_size=PAGE, cuda_graphs=False)
    runner.fused_kernels = runner.fused_kernels or device.type == "cpu"  # the interpreter on the CPU smoke run
    context = TINY_CONTEXT if args.tiny else CONTEXT
    width = -(-context // PAGE)
    runner.forward(ragged_step([(0, context - 1)], PAGE, width, device.type))  # the context the decode reads
    step = ragged_step([(context - 1, 1)], PAGE, width, device.type)
    with gemv_setting("off", tuned):
        eager = next_tokens(runner, runner.forward(step).hidden_states)
    rows = []
    for setting in ("off", "on", "tuned"):
        with gemv_setting(setting, tuned):
            rows.append({"model": model.name, "setting": setting, **graph_step(runner, step, width, eager, args.repeats),
                         **eager_kernels(runner, step)})  # fmt: skip
    return rows


def graph_step(runner: ModelRunner, step, width: int, eager: torch.Tensor, repeats: int) -> dict:
    try:
        runner.prepare_decode_graphs(ladder=(1,), max_blocks_per_seq=width)  # captures on CUDA
        replayed = next_tokens(runner, runner.forward(step).hidden_states)
        graph = runner.decode_graphs.graphs.get((1, 1))
        replay = graph.replay if graph is not None else lambda: runner.forward(step)
        return {"captured": graph is not None, "step_ms": median_ms(replay, runner.device.type, repeats),
                "token_agrees": bool(torch.equal(replayed, eager))}  # fmt: skip
    finally:
        runner.drop_decode_graphs()
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def eager_kernels(runner: ModelRunner, step, top: int = 8) -> dict:
    """Device kernels one eager step launches, their device ms, and the `top` by device time (empty on the CPU)."""
    if runner.device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    graphs, runner.decode_graphs = runner.decode_graphs, None
    try:
        runner.forward(step)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.forward(step)
            torch.cuda.synchronize()
    finally:
        runner.decode_graphs = graphs
    events = sorted((e for e in prof.key_averages() if self_us(e, cuda=True) > 0), key=lambda e: self_us(e, cuda=True), reverse=True)
    return {"kernels_per_eager_step": sum(e.count for e in events),
            "eager_device_ms": round(sum(self_us(e, cuda=True) for e in events) / 1e3, 4),
            "top": [{"name": e.key[:80], "count": e.count, "us": round(self_us(e, cuda=True), 1)} for e in events[:top]]}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = bench_dtype(device.type)
    models = (RANDOM_TINY_MODEL,) if args.tiny else tuple(args.models)
    tiles = TINY_TILES if args.tiny else TILES
    deadline = time.monotonic() + args.budget_s
    result: dict = {"device": device_name(device.type), "torch": torch.__version__,
                    "models": [m.name for m in models], "calls": args.calls}  # fmt: skip
    section = deadline_sections(result, deadline)
    kernels: list[dict] = []
    for model in models:
        section(f"kernels_{model.name}", lambda m=model: kernels.extend(kernel_rows(m, tiles, device, dtype, args)) or len(kernels))
    result["kernels"] = kernels
    steps: list[dict] = []
    for model in models:
        tuned = fastest_tiles(kernels, model.name)
        result[f"tuned_{model.name}"] = {f"{n}x{k}": list(t) for (n, k), t in tuned.items()}
        section(f"steps_{model.name}", lambda m=model, t=tuned: steps.extend(step_rows(m, t, device, dtype, args)) or len(steps))
    result["steps"] = steps
    return finish_run(result, args, deadline, table)


def table(result: dict) -> str:
    lines = [f"device {result['device']}, torch {result['torch']}, {result['elapsed_s']} s", "",
             "| model | op | weight | as served before µs | GEMV µs (its tiles) | fastest GEMV µs (tiles) | GB/s two / GEMV | rel diff |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    rows = result["kernels"]
    for model in result["models"]:
        for op in OPS:
            mine = [r for r in rows if r["model"] == model and r["op"] == op]
            separate = next((r for r in mine if r["path"] != "gemv"), None)
            gemvs = [r for r in mine if r["path"] == "gemv"]
            if separate is None or not gemvs:
                continue
            own, best = next(r for r in gemvs if r["default"]), min(gemvs, key=lambda r: r["us"])
            lines.append(f"| {model} | {op} | {'x'.join(map(str, separate['weight']))} | {separate['us']} | {own['us']} ({own['tiles']}) | "
                         f"{best['us']} ({best['tiles']}) | {separate['gb_per_s']} / {own['gb_per_s']} | {own['rel_diff']:.2e} |")  # fmt: skip
    lines += ["", "| model | GEMVs | batch-1 graph step ms | next token = eager (off) | kernels per eager step |", "|---|---|---|---|---|"]
    for r in result["steps"]:
        lines.append(f"| {r['model']} | {r['setting']} | {r['step_ms']} | {r['token_agrees']} | {r.get('kernels_per_eager_step')} |")
    for r in result["steps"]:
        if r["setting"] == "on" and r.get("top"):
            lines.append(f"{r['model']} eager step with the GEMVs, {r['eager_device_ms']} ms of kernels; the most: "
                         + "; ".join(f"{k['name'][:48]} x{k['count']} {k['us']} us" for k in r["top"]))  # fmt: skip
    errors = [name for name, value in result.items() if isinstance(value, dict) and ("error" in value or "skipped" in value)]
    return "\n".join(lines + ([f"not run or failed: {', '.join(errors)}"] if errors else []))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_check_arguments(parser, tiny="the tiny random model, two tile settings, context 20", repeats=20, budget_s=240, out="gpu_gemv.json",
                        what="graph replays per measurement")  # fmt: skip
    parser.add_argument("--models", type=Path, nargs="*", default=list(MODELS), help="config directories (dummy weights)")
    parser.add_argument("--calls", type=int, default=20, help="calls captured in each timed graph")


def main(args: argparse.Namespace) -> int:
    result = run(args)
    errors = [v for v in result.values() if isinstance(v, dict) and "error" in v]
    return 0 if result["kernels"] and result["steps"] and not errors else 1


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
