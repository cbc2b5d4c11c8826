"""The fused q/k-norm + RoPE + KV-write kernel (`triton_fused.rotate_and_store_triton`) on one GPU:
how many heads one program should take, per step size (issue 12, point 5).

The Qwen3-8B attention shape (32 q heads, 8 kv heads, head_dim 128, q/k norms, bf16, 16-slot
pages), random inputs, one layer. Per number of tokens (--tokens: decode steps up to a 32k
prompt) and heads per program (--heads-per-program, one warp each; 1 is the kernel as it was, one
program per token and head; the default, `triton_fused.ROPE_HEADS_PER_PROGRAM`, is marked):
- µs per call, as the median of --repeats replays of a CUDA graph of --calls calls (the way
  decode steps run; a long prefill's single launch is timed the same way), and GB/s of the bytes
  the kernel must move (qkv read, q written, k and v written);
- whether q and the written cache are bit-identical to one head per program's (the launch shape
  must never change the result), and max |diff| against the torch twin (`Attention.rotate_and_store`).
On CPU (the smoke run) the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1), timed by
the host clock and without graphs.

    sparkwire bench gpu-kernels rope --out $OUT/gpu_rope.json
    TRITON_INTERPRET=1 python ops/bench/gpu_rope_check.py --device cpu --tiny --out /tmp/rope.json
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from ops.bench.common import add_check_arguments, bench_dtype, deadline_sections, device_name, finish_run, graph_us, script
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.kv_cache import PagedKVCache
from services.scheduler.model.llama import Attention, rope_cos_sin, rope_inv_freq


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    page: int
    tokens: tuple[int, ...]


FULL = Shape(32, 8, 128, 16, (1, 8, 64, 128, 256, 512, 2048, 16384, 32768))
TINY = Shape(4, 2, 16, 4, (1, 5))


def config_for(shape: Shape, max_tokens: int) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": shape.heads * shape.head_dim,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "max_position_embeddings": max_tokens,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "eos_token_id": 1,
    })  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    from services.scheduler.model import triton_fused

    shape = TINY if args.tiny else FULL
    device, dtype = torch.device(args.device), bench_dtype(args.device)
    deadline = time.monotonic() + args.budget_s
    result: dict = {"device": device_name(args.device), "torch": torch.__version__,
                    "shape": shape.__dict__ | {"tokens": list(shape.tokens)},
                    "default_heads_per_program": triton_fused.ROPE_HEADS_PER_PROGRAM}  # fmt: skip
    section = deadline_sections(result, deadline)
    choices = sorted(set(args.heads_per_program))
    rows = []
    for num_tokens in args.tokens or shape.tokens:
        section(f"tokens_{num_tokens}", lambda n=num_tokens: rows.extend(token_rows(shape, n, choices, device, dtype, args)))
    result["rows"] = rows
    return finish_run(result, args, deadline, table)


def token_rows(shape: Shape, num_tokens: int, choices: list[int], device: torch.device, dtype: torch.dtype,
               args: argparse.Namespace) -> list[dict]:
    from services.scheduler.model.triton_fused import ROPE_HEADS_PER_PROGRAM, rotate_and_store_triton

    config = config_for(shape, num_tokens + 1)
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    attention = Attention(config, 0).to(device=device, dtype=dtype)
    with torch.no_grad():
        for norm in (attention.q_norm, attention.k_norm):
            norm.weight.copy_(1.0 + 0.2 * torch.randn(shape.head_dim, generator=gen, device=device, dtype=dtype))
    num_blocks = -(-num_tokens // shape.page)
    qkv = torch.randn(num_tokens, (shape.heads + 2 * shape.kv_heads) * shape.head_dim, generator=gen, device=device, dtype=dtype)
    positions = torch.randint(0, num_tokens + 1, (num_tokens,), generator=gen, device=device)
    rope = rope_cos_sin(rope_inv_freq(config).to(device), positions, dtype)
    slots = torch.randperm(num_blocks * shape.page, generator=gen, device=device)[:num_tokens]
    moved = qkv.numel() * qkv.element_size() + num_tokens * (shape.heads + 2 * shape.kv_heads) * shape.head_dim * qkv.element_size()
    twin_cache = PagedKVCache(config, num_blocks, shape.page, dtype, device)
    with torch.no_grad():
        twin = attention.rotate_and_store(qkv, rope, slots, twin_cache)
    norms = (attention.q_norm.weight, attention.k_norm.weight, attention.q_norm.eps)
    reference = None
    rows = []
    for per_program in choices:
        cache = PagedKVCache(config, num_blocks, shape.page, dtype, device)
        call = lambda: rotate_and_store_triton(qkv, *rope, slots, cache.key_cache(0), cache.value_cache(0), shape.heads, norms, per_program)  # noqa: E731
        q = call()
        written = cache.kv.clone()
        if reference is None:
            reference = (q, written)
        us = graph_us(call, device, args.calls, args.repeats)
        rows.append({
            "tokens": num_tokens, "heads_per_program": per_program, "us": us, "gb_per_s": round(moved / us / 1e3, 1),
            "default": per_program == ROPE_HEADS_PER_PROGRAM,
            "identical_to_first": bool(torch.equal(q, reference[0]) and torch.equal(written, reference[1])),
            "max_diff_vs_twin": max((q.float() - twin.float()).abs().max().item(), (written.float() - twin_cache.kv.float()).abs().max().item()),
        })  # fmt: skip
    return rows


def table(result: dict) -> str:
    lines = ["| tokens | heads / program | µs | GB/s | default | same result | max diff vs torch |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['tokens']} | {r['heads_per_program']} | {r['us']} | {r['gb_per_s']} | {'yes' if r['default'] else ''} "
                     f"| {r['identical_to_first']} | {r['max_diff_vs_twin']:.3g} |")  # fmt: skip
    errors = [name for name, value in result.items() if isinstance(value, dict) and ("error" in value or "skipped" in value)]
    return "\n".join(lines + ([f"not run or failed: {', '.join(errors)}"] if errors else []))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_check_arguments(parser, tiny="4 q / 2 kv heads of 16, 1 and 5 tokens", repeats=5, budget_s=120, out="gpu_rope.json",
                        what="graph replays per measurement")  # fmt: skip
    parser.add_argument("--tokens", type=int, nargs="*", default=None, help="step sizes (default: decode steps to a 32k prompt)")
    parser.add_argument("--heads-per-program", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    parser.add_argument("--calls", type=int, default=20, help="calls captured in each timed graph")


def main(args: argparse.Namespace) -> int:
    result = run(args)
    return 0 if result["rows"] and all(r["identical_to_first"] for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
