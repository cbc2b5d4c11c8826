"""The models of issue 42 on one GPU, dummy weights at the published shapes: Qwen3-30B-A3B (MoE)
decode steps against the floor of the bytes they must read, the fused MoE kernel against its torch
twin, and Qwen3-8B in FP8 (block-wise 128 x 128, and per-channel) against bf16, with FP8's logprobs
against its dequantized reference.

Sections, each in its own try/except; one that would start more than --budget-s after the start
is skipped:
- `moe_kernel`: one sparse layer's experts at the 30B-A3B shape (128 experts, top 8, H 2048, I 768)
  for 1, 64 and 2048 tokens, uneven random routing: µs of `triton_moe.fused_experts` and of
  `moe.experts_reference`, and the largest |diff| over the largest |value|; then the fused kernel on
  FP8 stacks (128 x 128 block scales) against the twin on their dequantized weights.
- `moe_steps`: the 30B-A3B decode step (context 256, CUDA graph replayed, the fused kernels on) at
  batch 1 and 64: ms/step, tok/s, and the floor: the bytes the step reads (attention, router, the
  distinct experts its routing hits, the LM head; measured from one eager step) at the measured
  copy bandwidth; the replay's next tokens against the eager step's. In bf16, then FP8 block-wise
  (projections and expert stacks; `x bf16` the step over bf16's).
- `fp8_steps_<layout>`: Qwen3-8B bf16, FP8 block-wise and FP8 per-channel (a section each), decode
  step at batch 1 and 64 as above; `fp8_steps` gathers them with each step over bf16's (issue 42's
  target: block-wise batch 1 <= 0.65).
- `fp8_w8a8`: is FP8 on CUDA right? In each FP8 layout's model, every `Fp8Linear` of every layer is
  checked during a decode step (batch 1 and 64) and a prefill of 4 x 64 tokens: its output on the
  device against `Fp8Linear.w8a8_reference` on the same input (fp32, activations quantized per token
  and 128 columns as the kernel does, per row on cuBLAS's path): per layer, the largest |diff| and
  that over the largest |reference| of its projections. Bound: bf16's rounding of the output (2^-8 of
  the largest value) and fp32 summation order; `path` says which path ran ("twin" off CUDA: then the
  numbers are FP8 activation quantization's own error). These steps run with the fused kernels off;
  step `decode 1 fused` (path "fp8 fused", where Triton runs) checks what fusing adds at one token:
  per layer, the FP8 GEMVs with their input stages (add + RMSNorm before q/k/v and gate/up, SiLU *
  up before down) against the norm or SiLU kernel then the projection's GEMV, bound: the same bits.
- `fp8_linear`: µs per call of each Qwen3-8B projection at batch 1 and 64 (a CUDA graph of 10 calls
  replayed): FP8 block-wise, FP8 per-channel and bf16 `F.linear`, with the weight's GB/s.
- `fp8_tiles`: for tuning `triton_fp8.tiles`: each projection through the block-wise kernels, at
  batch 1 the GEMV under every (BLOCK_N 8/16/32, columns a step 256/512/1024, warps 4/8) beside the
  tensor-core kernel's own tiling (what batch 1 ran before the GEMV), at 64 the tensor-core kernel
  under every (BLOCK_N 32/64/128, programs per SM 1/2/4/8, stages 3/4/5); `default` marks the tiling
  `tiles` chooses. The table lists the fastest and the default per projection, batch and kernel.
- `fp8_logprobs`: each FP8 layout's log-softmax over 4 prompts of 64 tokens against the same weights
  dequantized to bf16 (`Fp8Linear`'s twin, activations not quantized): largest |diff| over the
  reference's top-20 and over the whole vocabulary, and how often the greedy token agrees (through 36
  random layers this mostly measures FP8 activation rounding amplified; `fp8_w8a8` is the check).

    sparkwire bench gpu-models --out $OUT/gpu_models.json
    TRITON_INTERPRET=1 python ops/bench/gpu_models.py --device cpu --tiny --out /tmp/models.json  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import time

import torch

from ops.bench.common import (
    MODEL_CONFIGS, add_check_arguments, bench_dtype, copy_bandwidth_gb_s, deadline_sections, device_name, finish_run,
    median_ms, next_tokens, only, ragged_step, script, worst_row_rel_diff,
)  # fmt: skip
from services.scheduler.model import fp8
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.fp8 import FP8, Fp8Linear, Fp8Scheme, dequantize, empty_fp8_linears, scale_shape
from services.scheduler.model.kv_cache import PagedKVCache
from services.scheduler.model.moe import Experts, SparseMoE, empty_fp8_experts, experts_reference, route
from services.scheduler.model.registry import build_model
from services.scheduler.model.runner import ModelRunner

MOE_MODEL, DENSE_MODEL = MODEL_CONFIGS / "Qwen3-30B-A3B", MODEL_CONFIGS / "Qwen3-8B"
BATCHES, CONTEXT, PAGE = (1, 64), 256, 16
KERNEL_TOKENS = (1, 64, 2048)
MOE_FP8_BLOCK = (128, 128)  # Qwen3-30B-A3B-FP8's tiles
FP8_LAYOUTS = {"bf16": None, "fp8-block": Fp8Scheme(block=(128, 128)), "fp8-channel": Fp8Scheme()}
# --tiny: the same code on shapes a CPU runs in seconds (the kernel section in Triton's interpreter); a vocabulary
# of 2048: `common.ragged_step` draws its ids below that
TINY_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "max_position_embeddings": 512}  # fmt: skip
TINY_DENSE = {**{k: v for k, v in TINY_MOE.items() if "expert" not in k and "moe" not in k and k != "norm_topk_prob"},
              "architectures": ["Qwen3ForCausalLM"]}  # fmt: skip
TINY_BATCHES, TINY_CONTEXT, TINY_KERNEL_TOKENS, TINY_BLOCK = (1, 4), 20, (1, 5), (32, 32)
W8A8_BOUND = 1e-2  # fp8_w8a8: largest |diff| over largest |reference| a layer may show (bf16 output rounding: 2^-8)
LINEAR_CALLS = 10  # fp8_linear: calls per timed graph replay


# ---- dummy models ----


def model_config(args: argparse.Namespace, moe: bool, scheme: Fp8Scheme | None = None) -> ModelConfig:
    if args.tiny:
        config = ModelConfig.from_dict(TINY_MOE if moe else TINY_DENSE)
        scheme = dataclasses.replace(scheme, block=TINY_BLOCK if scheme.block else None) if scheme else None
    else:
        config = ModelConfig.from_pretrained(MOE_MODEL if moe else DENSE_MODEL, context_len=CONTEXT)
    return dataclasses.replace(config, quantization=scheme)


@torch.no_grad()
def dummy_runner(config: ModelConfig, device: torch.device, dtype: torch.dtype, num_seqs: int, context: int) -> ModelRunner:
    """Random weights drawn on the device, parameter by parameter (an expert stack is one draw: the
    loader's per-tensor host draws would take minutes at 30B); FP8 weights ~N(0, 1) with scales of ~0.02."""
    with torch.device("meta"):
        model = build_model(config).to(dtype)
        if config.quantization is not None:
            model = empty_fp8_experts(empty_fp8_linears(model, config.quantization), config.quantization)
    model = model.to_empty(device=device)
    model.init_rope(device)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        elif param.dtype == FP8:
            param.copy_(torch.randn(param.shape, generator=gen, device=device, dtype=torch.bfloat16).clamp(-fp8.FP8_MAX, fp8.FP8_MAX))
        elif name.endswith(("weight_scale", "weight_scale_inv", "proj_scale")):
            param.uniform_(0.018, 0.022, generator=gen)
        else:
            param.normal_(0.0, 0.02, generator=gen)
    model.eval()
    cache = PagedKVCache(config, num_seqs * -(-context // PAGE), PAGE, dtype, device)
    return ModelRunner(model, cache)


def free_device_memory() -> None:
    """Return what the dropped runner or tensors held, before the next one loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- sections ----


def uneven_ids(num_tokens: int, num_experts: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing with a skew (expert e's logit + e / E) so loads differ, as trained routers' do."""
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device) + torch.arange(num_experts, device=device) / num_experts
    return route(logits, top_k, renormalize=True)


@torch.no_grad()
def kernel_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict]:
    from services.scheduler.model.triton_moe import fused_experts

    config = model_config(args, moe=True)
    experts, hidden, inter, top_k = config.num_experts, config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    gen = torch.Generator(device=device).manual_seed(1)
    gate_up = 0.02 * torch.randn(experts, 2 * inter, hidden, generator=gen, device=device, dtype=dtype)
    down = 0.02 * torch.randn(experts, hidden, inter, generator=gen, device=device, dtype=dtype)
    block = TINY_BLOCK if args.tiny else MOE_FP8_BLOCK
    fp8_stacks = [(torch.randn(stack.shape, generator=gen, device=device) * 64).to(FP8) for stack in (gate_up, down)]
    fp8_scales = [torch.full(scale_shape(stack.shape, block), 0.02 / 64, device=device) for stack in fp8_stacks]
    fp8_twin = [dequantize(stack, scale, block, dtype) for stack, scale in zip(fp8_stacks, fp8_scales)]
    rows = []
    for tokens in TINY_KERNEL_TOKENS if args.tiny else KERNEL_TOKENS:
        x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype)
        weights, ids = uneven_ids(tokens, experts, top_k, device)
        fused = fused_experts(x, gate_up, down, weights, ids)
        twin = experts_reference(x, gate_up, down, weights, ids)
        rows.append({"tokens": tokens, "experts_hit": int(ids.unique().numel()),
                     "fused_us": 1e3 * median_ms(lambda: fused_experts(x, gate_up, down, weights, ids), device.type, args.repeats),
                     "twin_us": 1e3 * median_ms(lambda: experts_reference(x, gate_up, down, weights, ids), device.type, args.repeats),
                     "rel_diff": worst_row_rel_diff(fused.float(), twin.float()),
                     "fp8_fused_us": 1e3 * median_ms(lambda: fused_experts(x, *fp8_stacks, weights, ids, (*fp8_scales, block)),
                                                     device.type, args.repeats),
                     "fp8_rel_diff": worst_row_rel_diff(fused_experts(x, *fp8_stacks, weights, ids, (*fp8_scales, block)).float(),
                                                        experts_reference(x, *fp8_twin, weights, ids).float())})  # fmt: skip
    return rows


def step_bytes(runner: ModelRunner, experts_hit: list[int], num_tokens: int, context: int) -> int:
    """Bytes one decode step must read: every parameter but the input embedding and the expert
    stacks, each sparse layer's experts that its routing hit (`experts_hit`), and the K/V of
    `num_tokens` sequences of `context` tokens."""
    config = runner.config
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * runner.dtype.itemsize
    total = kv_per_token * num_tokens * context
    for name, param in runner.model.named_parameters():
        if "embed_tokens" not in name and ".experts." not in name:
            total += param.numel() * param.element_size()
    stacks = next((m for m in runner.model.modules() if isinstance(m, Experts)), None)  # every sparse layer's are alike
    expert_bytes = sum(p.numel() * p.element_size() for p in stacks.parameters()) // config.num_experts if stacks else 0  # scales too
    return total + expert_bytes * sum(experts_hit)


@contextlib.contextmanager
def routing_recorded(runner: ModelRunner):
    """Distinct experts each sparse layer's routing hits, per forward, appended to the yielded list."""
    hits: list[int] = []
    handles = [m.gate.register_forward_hook(lambda mod, inp, out, k=m.top_k: hits.append(int(out.topk(k, dim=-1).indices.unique().numel())))
               for m in runner.model.modules() if isinstance(m, SparseMoE)]  # fmt: skip
    try:
        yield hits
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def decode_row(runner: ModelRunner, batch: int, context: int, repeats: int, bandwidth: float) -> dict:
    width = -(-context // PAGE)
    step = ragged_step([(context - 1, 1)] * batch, PAGE, width, runner.device.type)
    with routing_recorded(runner) as hits:
        eager = next_tokens(runner, runner.forward(step).hidden_states)
    try:
        runner.prepare_decode_graphs(ladder=(batch,), max_blocks_per_seq=width)
        replayed = next_tokens(runner, runner.forward(step).hidden_states)
        graph = runner.decode_graphs.graphs.get((batch, 1))
        step_ms = median_ms(graph.replay if graph is not None else lambda: runner.forward(step), runner.device.type, repeats)
    finally:
        runner.drop_decode_graphs()
    read = step_bytes(runner, hits, batch, context)
    floor_ms = read / bandwidth / 1e6 if bandwidth else 0.0
    return {"batch": batch, "captured": graph is not None, "step_ms": step_ms, "tok_per_s": round(1e3 * batch / step_ms, 1),
            "bytes_read_gb": round(read / 1e9, 3), "floor_ms": round(floor_ms, 4),
            "floor_over_step": round(floor_ms / step_ms, 3) if floor_ms else None,
            "experts_hit_per_layer": round(sum(hits) / len(hits), 1) if hits else None,
            "next_tokens_agree": bool(torch.equal(replayed, eager))}  # fmt: skip


def moe_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, bandwidth: float) -> list[dict]:
    """The 30B-A3B decode rows in bf16, then with every projection and expert stack FP8 block-wise."""
    batches, context = (TINY_BATCHES, TINY_CONTEXT) if args.tiny else (BATCHES, CONTEXT)
    rows = []
    for layout, scheme in (("bf16", None), ("fp8-block", Fp8Scheme(block=MOE_FP8_BLOCK))):
        runner = dummy_runner(model_config(args, moe=True, scheme=scheme), device, dtype, max(batches), context)
        rows += [{"model": "Qwen3-30B-A3B", "layout": layout, **decode_row(runner, b, context, args.repeats, bandwidth)} for b in batches]
        del runner
        free_device_memory()
    base = {r["batch"]: r["step_ms"] for r in rows if r["layout"] == "bf16"}
    return [{**r, "step_over_bf16": round(r["step_ms"] / base[r["batch"]], 3)} for r in rows]


def layout_rows(args: argparse.Namespace, layout: str, device: torch.device, dtype: torch.dtype, bandwidth: float,
                logprobs: list[dict], w8a8: list[dict]) -> list[dict]:  # fmt: skip
    """One layout's decode rows (and, for FP8, its logprob agreement and W8A8 check)."""
    batches, context = (TINY_BATCHES, TINY_CONTEXT) if args.tiny else (BATCHES, CONTEXT)
    scheme = FP8_LAYOUTS[layout]
    runner = dummy_runner(model_config(args, moe=False, scheme=scheme), device, dtype, max(batches), context)
    try:
        if scheme is not None:
            logprobs.append({"layout": layout, **logprob_agreement(runner, length=min(64, context))})
            w8a8.extend({"layout": layout, **row} for row in w8a8_rows(runner, batches, context))
        return [{"model": "Qwen3-8B", "layout": layout, **decode_row(runner, b, context, args.repeats, bandwidth)} for b in batches]
    finally:
        del runner
        free_device_memory()


def fp8_rows(result: dict) -> list[dict]:
    """Every layout's rows, each step over bf16's at its batch."""
    rows = [r for layout in FP8_LAYOUTS for r in result.get(f"fp8_steps_{layout}") or [] if isinstance(r, dict)]
    base = {r["batch"]: r["step_ms"] for r in rows if r["layout"] == "bf16"}
    return [{**r, "step_over_bf16": round(r["step_ms"] / base[r["batch"]], 3) if r["batch"] in base else None} for r in rows]


@torch.inference_mode()
def w8a8_rows(runner: ModelRunner, batches: tuple[int, ...], context: int) -> list[dict]:
    """Per (step, layer): every Fp8Linear's device output against its `w8a8_reference`, checked in a
    forward hook as eager steps run (decode at each batch, then a prefill of 4 prompts) with the fused
    kernels off: fused, a one-token step's norms and SiLU take the projection after them along, which
    then never sees its input. Those fused GEMVs: `fused_gemv_rows`, where Triton runs."""
    length, width = min(64, context), -(-context // PAGE)
    steps = [(f"decode {b}", ragged_step([(context - 1, 1)] * b, PAGE, width, runner.device.type)) for b in batches]
    steps.append((f"prefill 4x{length}", ragged_step([(0, length)] * 4, PAGE, -(-length // PAGE), runner.device.type)))
    with fused_kernels(runner, False):
        rows = hooked_w8a8_rows(runner, steps)
    if not triton_runs(runner.device):
        return rows
    return rows + fused_gemv_rows(runner, ragged_step([(context - 1, 1)], PAGE, width, runner.device.type))


def hooked_w8a8_rows(runner: ModelRunner, steps: list[tuple[str, object]]) -> list[dict]:
    """`w8a8_rows`' forward-hook check over these (name, batch) steps."""
    worst: dict[tuple[str, int], dict] = {}
    current = [""]

    def check(layer: int, module: Fp8Linear, inputs: tuple, output: torch.Tensor) -> None:
        want = module.w8a8_reference(inputs[0])
        row = worst.setdefault((current[0], layer), {"step": current[0], "layer": layer, "max_abs": 0.0, "ref_max": 0.0})
        row["max_abs"] = max(row["max_abs"], float((output.float() - want).abs().max()))
        row["ref_max"] = max(row["ref_max"], float(want.abs().max()))

    handles = [module.register_forward_hook(lambda m, i, o, layer=int(name.split(".")[2]): check(layer, m, i, o))
               for name, module in runner.model.named_modules() if isinstance(module, Fp8Linear)]  # fmt: skip
    try:
        for current[0], step in steps:
            runner.forward(step)
    finally:
        for handle in handles:
            handle.remove()
    path = "fp8" if fp8.fp8_matmul_available(runner.device) else "twin"
    return [{**row, "path": path, "max_rel": row["max_abs"] / max(row["ref_max"], 1e-30),
             "within_bound": row["max_abs"] <= W8A8_BOUND * row["ref_max"]} for row in worst.values()]  # fmt: skip


@torch.inference_mode()
def fused_gemv_rows(runner: ModelRunner, one_token_step) -> list[dict]:
    """Per layer, on the inputs a one-token step gives it (the fused kernels on, W8A8 forced: Triton's
    interpreter off CUDA): the fused FP8 GEMVs (add + RMSNorm + q/k/v, + gate/up; SiLU * up + down)
    against the unfused kernels (the norm or SiLU kernel, then the projection's GEMV). Bound: none,
    the same bits (`within_bound`: max_abs 0), the residual's too."""
    layers = runner.model.model.layers
    inputs: dict[int, tuple] = {}  # layer -> (x, residual)

    def record(index: int, args: tuple) -> None:  # a pre-hook's None keeps the layer's arguments
        inputs[index] = args[:2]

    handles = [layer.register_forward_pre_hook(lambda m, args, i=i: record(i, args)) for i, layer in enumerate(layers)]
    try:
        with fused_kernels(runner, True), fp8_path(available=True):
            runner.forward(one_token_step)
            rows = [fused_gemv_row(index, layers[index], *inputs[index]) for index in sorted(inputs)]
    finally:
        for handle in handles:
            handle.remove()
    return rows


def fused_gemv_row(index: int, layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> dict:
    from services.scheduler.model.llama import add_rms_norm, norm_linear, silu_linear, silu_mul

    pairs = []  # (fused, unfused)
    for norm, linear in ((layer.input_layernorm, layer.self_attn.qkv_proj), (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
        out, summed = norm_linear(x, residual, norm, linear, fused=True)
        normed, want_summed = add_rms_norm(x, residual, norm, fused=True)
        pairs += [(out, linear(normed)), (summed, want_summed)]
    gate_up = pairs[2][1]
    pairs.append((silu_linear(gate_up, layer.mlp.down_proj, fused=True), layer.mlp.down_proj(silu_mul(gate_up, fused=True))))
    max_abs = max(float((got.float() - want.float()).abs().max()) for got, want in pairs)
    ref_max = max(float(want.float().abs().max()) for _, want in pairs)
    return {"step": "decode 1 fused", "layer": index, "max_abs": max_abs, "ref_max": ref_max, "path": "fp8 fused",
            "max_rel": max_abs / max(ref_max, 1e-30), "within_bound": max_abs == 0.0}  # fmt: skip


@contextlib.contextmanager
def fused_kernels(runner: ModelRunner, on: bool):
    """The runner's fused kernels on or off for the block's duration (no graphs captured)."""
    saved = runner.fused_kernels
    runner.fused_kernels = on
    try:
        yield
    finally:
        runner.fused_kernels = saved


def triton_runs(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of a decoder layer's four projections."""
    heads, kv, hd, hidden = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
    inter = config.intermediate_size
    return {"qkv_proj": ((heads + 2 * kv) * hd, hidden), "o_proj": (hidden, heads * hd), "gate_up_proj": (2 * inter, hidden),
            "down_proj": (hidden, inter)}  # fmt: skip


@torch.inference_mode()
def fp8_linear_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(2)
    for name, (n, k) in projection_shapes(model_config(args, moe=False)).items():
        layers = {"bf16": torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)}
        for layout, scheme in FP8_LAYOUTS.items():
            if scheme is not None:
                block = (TINY_BLOCK if args.tiny else scheme.block) if scheme.block else None
                layers[layout] = Fp8Linear(k, n, False, block, dtype).to(device)
                layers[layout].weight.copy_(torch.randn(n, k, generator=gen, device=device).to(FP8))
                layers[layout].scale.fill_(0.02)
        for batch in TINY_BATCHES if args.tiny else BATCHES:
            x = torch.randn(batch, k, generator=gen, device=device, dtype=dtype)
            for layout, layer in layers.items():
                us = 1e3 * median_ms(replayed(lambda layer=layer: layer(x), device), device.type, args.repeats) / LINEAR_CALLS
                weight_bytes = layer.weight.numel() * layer.weight.element_size()
                rows.append({"projection": name, "n": n, "k": k, "batch": batch, "layout": layout, "us": round(us, 2),
                             "weight_gb_per_s": round(weight_bytes / us / 1e3, 1)})  # fmt: skip
    return rows


# fp8_tiles: the decode tilings tried against `triton_fp8.tiles`' choice (block-wise 128 x 128), for tuning it: the
# tensor-core kernel's (BLOCK_N, programs per SM, stages) past one token, the GEMV's (BLOCK_N, columns a step, warps) at one
TILE_CANDIDATES = [(block_n, per_sm, stages) for block_n in (32, 64, 128) for per_sm in (1, 2, 4, 8) for stages in (3, 4, 5)]
GEMV_CANDIDATES = [(block_n, step_k, warps) for block_n in (8, 16, 32) for step_k in (256, 512, 1024) for warps in (4, 8)]


@torch.inference_mode()
def fp8_tile_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """µs of each Qwen3-8B projection through the block-wise FP8 kernels at each decode batch, under
    each candidate tiling: at batch 1 the GEMV's candidates and the tensor-core kernel's own tiling
    (what batch 1 took before the GEMV), past it the tensor-core kernel's candidates."""
    from services.scheduler.model import triton_fp8

    block = TINY_BLOCK if args.tiny else (128, 128)
    sms = triton_fp8.num_sms(device)
    gen = torch.Generator(device=device).manual_seed(3)
    rows = []
    for name, (n, k) in projection_shapes(model_config(args, moe=False)).items():
        layer = Fp8Linear(k, n, False, block, dtype).to(device)
        layer.weight.copy_(torch.randn(n, k, generator=gen, device=device).to(FP8))
        layer.scale.fill_(0.02)
        for batch in TINY_BATCHES if args.tiny else BATCHES:
            x = torch.randn(batch, k, generator=gen, device=device, dtype=dtype)
            default = triton_fp8.tiles(batch, n, k, block[1], sms, block[0])
            for kernel, setting, plan in candidate_plans(args, triton_fp8, batch, n, k, block, sms):
                us = 1e3 * median_ms(replayed(lambda: triton_fp8.fp8_linear(x, layer.weight, layer.scale, block, plan), device),
                                     device.type, args.repeats) / LINEAR_CALLS  # fmt: skip
                rows.append({"projection": name, "batch": batch, "kernel": kernel, "tiles": setting, "splits": plan.splits,
                             "us": round(us, 2), "weight_gb_per_s": round(n * k / us / 1e3, 1), "default": plan == default})  # fmt: skip
    return rows


def candidate_plans(args: argparse.Namespace, triton_fp8, batch: int, n: int, k: int, block: tuple[int, int], sms: int):
    """(kernel, its setting as text, `triton_fp8.Tiles`) for each tiling fp8_tiles times."""
    if batch == triton_fp8.GEMV_ROWS:
        default = triton_fp8.tensor_core_tiles(batch, n, k, block[1], sms)
        yield "tensor-core", f"BLOCK_N {default.block_n}, {triton_fp8.PROGRAMS_PER_SM}/SM, stages {default.num_stages}", default
        for block_n, step_k, warps in GEMV_CANDIDATES[:2] if args.tiny else GEMV_CANDIDATES:
            plan = triton_fp8.gemv_tiles(n, k, block[1], sms, block[0], block_n, step_k, warps)
            yield "gemv", f"BLOCK_N {plan.block_n}, {plan.groups_per_step * block[1]} columns, {warps} warps", plan
        return
    for block_n, per_sm, stages in TILE_CANDIDATES[:2] if args.tiny else TILE_CANDIDATES:
        with tiles_set(triton_fp8, block_n, per_sm):
            plan = dataclasses.replace(triton_fp8.tensor_core_tiles(batch, n, k, block[1], sms), num_stages=stages)
        yield "tensor-core", f"BLOCK_N {block_n}, {per_sm}/SM, stages {stages}", plan


@contextlib.contextmanager
def tiles_set(module, block_n: int, per_sm: int):
    """`module.tensor_core_tiles` with these decode tiles, for the block's duration."""
    saved = module.DECODE_BLOCK_N, module.PROGRAMS_PER_SM
    module.DECODE_BLOCK_N, module.PROGRAMS_PER_SM = block_n, per_sm
    try:
        yield
    finally:
        module.DECODE_BLOCK_N, module.PROGRAMS_PER_SM = saved


def replayed(fn, device: torch.device):
    """LINEAR_CALLS calls of fn: one CUDA graph's replay on CUDA (no host launch gaps), a loop elsewhere."""
    if device.type != "cuda":
        return lambda: [fn() for _ in range(LINEAR_CALLS)]
    fn()  # compiles before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LINEAR_CALLS):
            fn()
    return graph.replay


@contextlib.contextmanager
def fp8_path(available: bool):
    """Every `Fp8Linear` on the W8A8 kernels (available: off CUDA, Triton's interpreter runs them) or on
    its twin (the weight dequantized to the activations' dtype, the plain linear)."""
    saved = fp8.fp8_matmul_available
    fp8.fp8_matmul_available = lambda device: available
    try:
        yield
    finally:
        fp8.fp8_matmul_available = saved


@torch.inference_mode()
def logprob_agreement(runner: ModelRunner, length: int, num_prompts: int = 4) -> dict:
    step = ragged_step([(0, length)] * num_prompts, PAGE, -(-length // PAGE), runner.device.type)
    got = torch.log_softmax(runner.compute_logits(runner.forward(step).hidden_states), dim=-1)  # [T, V]
    with fp8_path(available=False):
        want = torch.log_softmax(runner.compute_logits(runner.forward(step).hidden_states), dim=-1)
    top = want.topk(20, dim=-1).indices
    return {"rows": int(got.shape[0]), "max_abs_diff_top20": float((got.gather(1, top) - want.gather(1, top)).abs().max()),
            "max_abs_diff_all": float((got - want).abs().max()),
            "greedy_agree": round(float((got.argmax(-1) == want.argmax(-1)).float().mean()), 4)}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = bench_dtype(device.type)
    deadline = time.monotonic() + args.budget_s
    bandwidth = copy_bandwidth_gb_s(device.type)
    result: dict = {"device": device_name(device.type), "torch": torch.__version__, "copy_gb_per_s": round(bandwidth, 1),
                    "context": TINY_CONTEXT if args.tiny else CONTEXT}  # fmt: skip
    section = only(args.sections, deadline_sections(result, deadline))
    if triton_runs(device):
        section("moe_kernel", lambda: kernel_rows(args, device, dtype))
        free_device_memory()  # the kernel rows' expert stacks, before the 30B model
    else:
        result["moe_kernel"] = {"skipped": "needs CUDA or TRITON_INTERPRET=1"}
    section("moe_steps", lambda: moe_rows(args, device, dtype, bandwidth))
    logprobs: list[dict] = []
    w8a8: list[dict] = []
    for layout in FP8_LAYOUTS:
        section(f"fp8_steps_{layout}", lambda layout=layout: layout_rows(args, layout, device, dtype, bandwidth, logprobs, w8a8))
    result["fp8_steps"] = fp8_rows(result) if any(f"fp8_steps_{layout}" in result for layout in FP8_LAYOUTS) else []
    result["fp8_logprobs"] = logprobs
    result["fp8_w8a8"] = w8a8
    section("fp8_linear", lambda: fp8_linear_rows(args, device, dtype))
    section("fp8_tiles", lambda: fp8_tile_rows(args, device, dtype))
    free_device_memory()
    return finish_run(result, args, deadline, table)


def table(result: dict) -> str:
    lines = [f"device {result['device']}, torch {result['torch']}, copy {result['copy_gb_per_s']} GB/s, {result['elapsed_s']} s", "",
             "| MoE experts, tokens | experts hit | fused µs | twin µs | rel diff | FP8 fused µs | FP8 rel diff |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["moe_kernel"] if isinstance(result.get("moe_kernel"), list) else []:
        lines.append(f"| {r['tokens']} | {r['experts_hit']} | {r['fused_us']:.1f} | {r['twin_us']:.1f} | {r['rel_diff']:.2e} "
                     f"| {r['fp8_fused_us']:.1f} | {r['fp8_rel_diff']:.2e} |")  # fmt: skip
    lines += ["", "| model | layout | batch | ms/step | tok/s | floor ms (GB read) | floor/step | x bf16 | tokens = eager |",
              "|---|---|---|---|---|---|---|---|---|"]
    steps = [*(result["moe_steps"] if isinstance(result.get("moe_steps"), list) else []),
             *(result["fp8_steps"] if isinstance(result["fp8_steps"], list) else [])]  # fmt: skip
    for r in steps:
        lines.append(f"| {r['model']} | {r.get('layout', 'bf16')} | {r['batch']} | {r['step_ms']} | {r['tok_per_s']} | {r['floor_ms']} "
                     f"({r['bytes_read_gb']}) | {r['floor_over_step']} | {r.get('step_over_bf16', '')} | {r['next_tokens_agree']} |")  # fmt: skip
    lines += ["", "| FP8 layout | rows | max |Δ logprob| top-20 | max |Δ| all | greedy agree |", "|---|---|---|---|---|"]
    for r in result["fp8_logprobs"]:
        lines.append(f"| {r['layout']} | {r['rows']} | {r['max_abs_diff_top20']:.4f} | {r['max_abs_diff_all']:.4f} | {r['greedy_agree']} |")
    lines += ["", "| FP8 W8A8 check: layout | step | path | layers | worst layer | max |diff| | over max |ref| | all within bound |",
              "|---|---|---|---|---|---|---|---|"]
    for (layout, step), rows in sorted(_grouped(result["fp8_w8a8"], ("layout", "step")).items()):
        bad = max(rows, key=lambda r: r["max_rel"])
        lines.append(f"| {layout} | {step} | {bad['path']} | {len(rows)} | {bad['layer']} | {bad['max_abs']:.3g} | {bad['max_rel']:.2e} "
                     f"| {all(r['within_bound'] for r in rows)} |")  # fmt: skip
    linear = result.get("fp8_linear")
    if isinstance(linear, list):
        lines += ["", "| projection (N x K) | batch | " + " | ".join(f"{layout} µs (GB/s)" for layout in FP8_LAYOUTS) + " |",
                  "|---|---|" + "---|" * len(FP8_LAYOUTS)]  # fmt: skip
        for (name, batch), rows in _grouped(linear, ("projection", "batch")).items():
            cells = {r["layout"]: f"{r['us']} ({r['weight_gb_per_s']})" for r in rows}
            lines.append(f"| {name} ({rows[0]['n']} x {rows[0]['k']}) | {batch} | " + " | ".join(cells.get(lay, "") for lay in FP8_LAYOUTS) + " |")
    tiles = result.get("fp8_tiles")
    if isinstance(tiles, list):
        lines += ["", "| FP8 tiles: projection | batch | kernel | default µs, GB/s (tiles) | best µs, GB/s (tiles) |", "|---|---|---|---|---|"]
        for (name, batch, kernel), rows in _grouped(tiles, ("projection", "batch", "kernel")).items():
            best, default = min(rows, key=lambda r: r["us"]), next((r for r in rows if r["default"]), None)
            cell = lambda r: f"{r['us']}, {r['weight_gb_per_s']} ({r['tiles']}, {r['splits']} splits)" if r else "-"  # noqa: E731
            lines.append(f"| {name} | {batch} | {kernel} | {cell(default)} | {cell(best)} |")
    errors = [name for name, value in result.items() if isinstance(value, dict) and ("error" in value or "skipped" in value)]
    return "\n".join(lines + ([f"not run or failed: {', '.join(errors)}"] if errors else []))


def _grouped(rows: list[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[key] for key in keys), []).append(row)
    return groups


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_check_arguments(parser, tiny="tiny MoE and dense shapes, context 20", repeats=20, budget_s=240, out="gpu_models.json",
                        what="replays per measurement")  # fmt: skip
    parser.add_argument("--sections", nargs="*", default=None, help="run only these (moe_kernel, moe_steps, "
                        f"{', '.join('fp8_steps_' + layout for layout in FP8_LAYOUTS)}, fp8_linear, fp8_tiles); default all")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    result = run(args)
    if args.sections:  # every section asked for ran
        return 0 if all(name in result and not (isinstance(result[name], dict) and result[name].keys() & {"error", "skipped"})
                        for name in args.sections) else 1  # fmt: skip
    return 0 if isinstance(result.get("moe_steps"), list) and len(result["fp8_steps"]) == 2 * len(FP8_LAYOUTS) else 1


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
