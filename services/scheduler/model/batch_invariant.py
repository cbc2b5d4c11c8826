"""Batch-invariant numerics (`--deterministic`): every number a row gets is a function of that row
alone, whatever else shares the step.

A GEMM's rounding depends on its reduction order, and libraries pick that order (tile shape,
split-K, the tensor-core instruction) from the whole problem's shape, M included: the same row
multiplied alone and among 63 others may round differently. Here:
- `invariant_linear` on CUDA is a Triton matmul with one tile configuration per weight shape (N, K),
  split-K included, whatever M: every output tile walks each K split in the same BLOCK_K steps, the
  splits' fp32 partials are added in split order, and a row's products meet only its own row of x.
  Elsewhere its twin multiplies each row as its own [1, K] @ [K, N] call: the same call, on a fresh
  contiguous row, whatever the batch.
- `attend_rowwise` is the attention twin: each query token over exactly the keys its position
  sees, one call per token, so a decode query, a verify block's query and a prefill chunk's query at
  the same position run the same arithmetic. The kernel side is `triton_varlen` with a fixed tile
  (`attention.plan_varlen(invariant=True)`).
Norms, RoPE, the K/V write and SiLU are per-row already (`triton_fused`: one program per row); norms
outside the fused path (Gemma's, the drafter's) take its norm kernel too (`llama.norm_rows`).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear whose product is batch-invariant once `invariant` is set (`set_batch_invariant`)."""

    invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias) if self.invariant else F.linear(x, self.weight, self.bias)


def set_batch_invariant(model: nn.Module, on: bool, row_kernels: bool | None = None) -> None:
    """Every `Linear` of `model`, every module with a `batch_invariant` flag (the model itself, for a
    tied LM head; the drafter's attention) computes batch-invariantly; with row_kernels, every norm
    with a `row_kernel` flag runs on triton_fused's one-program-per-row kernel (None: where Triton
    runs, CUDA; the interpreter in tests)."""
    rows = on and (_on_triton_device(model) if row_kernels is None else row_kernels)
    for module in model.modules():
        if isinstance(module, Linear):
            module.invariant = on
        if hasattr(module, "row_kernel"):
            module.row_kernel = rows
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = on
    model.batch_invariant = on


def _on_triton_device(model: nn.Module) -> bool:
    weight = next(model.parameters(), None)
    return weight is not None and weight.is_cuda and has_triton()


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N], each row's value independent of the others."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if x.device.type == "cuda" and has_triton():
        out = matmul_triton(rows, weight, bias)
    else:
        out = linear_rowwise(rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear_rowwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin: x [M, K] -> [M, N], one identical [1, K] product per row (a fresh, aligned copy of it)."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.result_type(x, weight), device=x.device)
    for index in range(x.shape[0]):
        out[index] = F.linear(x[index : index + 1].clone(), weight, bias)[0]
    return out


# A one-row step streams the weight once, so its time is the weight's bytes over the bandwidth the
# step's programs keep busy: where N gives too few tiles, K is split until about this many programs
# per SM stream their own slice (two 64-row tiles of three stages fill an SM's shared memory).
SPLIT_PROGRAMS_PER_SM = 2
SPLIT_BLOCK_N = 64
MIN_STEPS_PER_SPLIT = 4  # BLOCK_K steps a split keeps, so each program's loads still pipeline


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    splits: int = 1  # programs along K, each cdiv(K / BLOCK_K, splits) whole steps; > 1: fp32 partials added in split order


def tile_config(n: int, k: int, num_sms: int) -> TileConfig:
    """The one tile configuration of a weight [N, K], whatever M (a function of N, K and the card
    alone, so a row's reduction order is too). A one-row step is bandwidth-bound and must keep most
    SMs streaming: N fine enough for a program per SM where that takes tiles of 128 (or where K is
    too short to split, down to 16), else 64-wide tiles with K split into whole BLOCK_K steps."""
    block_k = 128 if k % 128 == 0 else 64
    steps = -(-k // block_k)
    wanted = SPLIT_PROGRAMS_PER_SM * num_sms // -(-n // SPLIT_BLOCK_N)
    splits = max(1, min(wanted, steps // MIN_STEPS_PER_SPLIT))
    if -(-n // 128) >= num_sms or splits == 1:
        block_n = next((b for b in (128, 64, 32) if -(-n // b) >= num_sms), 16)
        return TileConfig(block_m=64, block_n=block_n, block_k=block_k, num_warps=4, num_stages=3)
    per_split = -(-steps // splits)
    return TileConfig(block_m=64, block_n=SPLIT_BLOCK_N, block_k=block_k, num_warps=4, num_stages=3, splits=-(-steps // per_split))


def matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, num_sms: int | None = None
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] in x's dtype, fp32 accumulation, K split as
    `tile_config` says for the weight's shape and `num_sms` (None: this card's)."""
    from services.scheduler.model.triton_matmul import launch_matmul

    if num_sms is None:
        num_sms = device_sms(x.device.index) if x.device.type == "cuda" else 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    return launch_matmul(x, weight, bias, out, tile_config(weight.shape[0], weight.shape[1], num_sms))


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def device_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).multi_processor_count


def attend_rowwise(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    token_seq: list[int],
    visible: list[int],
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """softmax(q k^T * scale) v of each token t over exactly keys max(0, visible[t] - window) ..
    visible[t] - 1 of sequence token_seq[t] (window 0: from 0), fp32 inside, one call per token:
    the arithmetic depends on the token's position alone. query [T, Hq, D] -> [T, Hq, D]; tokens with
    visible 0 (padding) get zeros."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    out = torch.zeros_like(query)
    tables = block_tables.long().clamp_min(0)
    for t in range(num_tokens):
        end = visible[t]
        if end <= 0:
            continue
        start = max(0, end - window) if window else 0
        blocks = tables[token_seq[t], : -(-end // page)]
        keys = key_cache[blocks].flatten(0, 1)[start:end].float()  # [L, Hkv, D]
        values = value_cache[blocks].flatten(0, 1)[start:end].float()  # [L, Hkv, D]
        q = query[t].to(torch.float32, copy=True).view(num_kv_heads, num_heads // num_kv_heads, head_dim)  # [Hkv, G, D]
        scores = torch.einsum("hgd,khd->hgk", q, keys) * scale  # [Hkv, G, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        row = torch.einsum("hgk,khd->hgd", scores.softmax(dim=-1), values)  # [Hkv, G, D]
        out[t] = row.reshape(num_heads, head_dim).to(query.dtype)
    return out
