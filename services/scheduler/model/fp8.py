"""FP8 weights: the decoder's projections (q/k/v, o, gate/up, down) as float8_e4m3fn with fp32 scales.

Three layouts, one module (`Fp8Linear`), dequantized as W = W8 * scale:
- block-wise (`quantization_config.weight_block_size` [bn, bk], DeepSeek/Qwen3-FP8): one scale per
  bn x bk tile, shipped as `weight_scale_inv` [ceil(N / bn), ceil(K / bk)] (a multiplier, despite the name);
- per-tensor / per-channel (quant_method fp8 without a block size): `weight_scale`, one scalar or one
  per output row, held as one per row [N] so that fused q/k/v and gate/up keep each part's own;
- `--quantization fp8` (`quantize_linears`): a bf16 checkpoint's weights quantized at load, per row
  (amax / 448).
Activations are quantized per token on the fly ("dynamic": a per-tensor static `input_scale` is
refused at config time): per token and column group inside the Triton kernel of `triton_fp8.py`
(block-wise weights; per-row ones in decode-sized steps), per token for per-row weights in larger
steps (`torch._scaled_mm`, row-wise scales).
That path needs float8 tensor cores (CUDA compute capability 8.9+); elsewhere (CPU, older GPUs)
the twin dequantizes the weight to the activations' dtype and runs the plain linear: the CPU tests'
reference, which the GPU path matches to FP8 activation rounding (ops/bench gpu-models reports it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SUPPORTED_QUANTIZATIONS = ("fp8",)  # quantization_config quant_method values loaded as shipped
# Per-row weights past this many rows: cuBLAS's row-scaled FP8 GEMM (`torch._scaled_mm`), its
# activation quantized by torch ops; at or under it the Triton kernel, which quantizes inside.
CUBLAS_MIN_ROWS = 16
QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the router and lm_head stay unquantized


@dataclass(frozen=True)
class Fp8Scheme:
    block: tuple[int, int] | None = None  # (rows, columns) of a weight scale's tile; None: one scale per row
    skipped: tuple[str, ...] = ()  # module names (prefixes) the checkpoint left unquantized


class Fp8Linear(nn.Module):
    """y = x W^T + b with W float8_e4m3fn [N, K] and its scales; the bias (if any) in the model's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int] | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        if block is None:
            self.weight_scale = nn.Parameter(torch.empty(out_features), requires_grad=False)  # [N] fp32
        else:
            tiles = (-(-out_features // block[0]), -(-in_features // block[1]))
            self.weight_scale_inv = nn.Parameter(torch.empty(tiles), requires_grad=False)  # [N / bn, K / bk] fp32
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    @property
    def scale(self) -> torch.Tensor:
        return self.weight_scale if self.block is None else self.weight_scale_inv

    def row_parts(self) -> Iterator[tuple[str, torch.Tensor | None, int]]:
        """(checkpoint suffix, tensor, output rows per tensor row) for splitting a fused projection by rows."""
        yield "weight", self.weight, 1
        yield ("weight_scale", self.weight_scale, 1) if self.block is None else ("weight_scale_inv", self.weight_scale_inv, self.block[0])
        yield "bias", self.bias, 1

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W8 * scale [N, K] in fp32, rounded once to dtype."""
        scale = self.scale.float()
        if self.block is None:
            return (self.weight.float() * scale[:, None]).to(dtype)
        rows, cols = self.block
        full = scale.repeat_interleave(rows, dim=0)[: self.out_features].repeat_interleave(cols, dim=1)
        return (self.weight.float() * full[:, : self.in_features]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fp8_matmul_available(x.device):
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        if self.block is None and x.numel() > CUBLAS_MIN_ROWS * x.shape[-1]:
            out = scaled_mm_rows(x, self.weight, self.weight_scale)
        else:
            from services.scheduler.model.triton_fp8 import fp8_linear

            out = fp8_linear(x, self.weight, self.scale, self.block)
        return out if self.bias is None else out + self.bias


def fp8_matmul_available(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA compute capability 8.9 (Ada) or later."""
    return device.type == "cuda" and _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # a fixed property of the card: asked once, not per layer


def quantize_rows(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], fp32 scales [M, 1]) with x ~= q * scale, one scale per row (amax / 448;
    `amax` [M, 1]: each row's, given, where x holds a part of each row)."""
    amax = x.abs().amax(dim=-1, keepdim=True) if amax is None else amax
    scale = amax.float().clamp(min=1e-12) / FP8_MAX  # [M, 1]
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_mm_rows(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) times FP8 weight [N, K] with per-row weight scales [N] -> [M, N] in x's dtype."""
    x_q, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    out_dtype = x.dtype if x.dtype != torch.float32 else torch.bfloat16  # row-wise _scaled_mm writes 16-bit
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.float().view(1, -1), out_dtype=out_dtype)
    return out.to(x.dtype).view(*x.shape[:-1], -1)


@torch.no_grad()
def quantize_weight_rows(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (FP8 [N, K], fp32 per-row scales [N]): `--quantization fp8`."""
    q, scale = quantize_rows(weight, amax)
    return q, scale.squeeze(1)


def fp8_modules(model: nn.Module, scheme: Fp8Scheme) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of every projection the scheme quantizes."""
    for parent_name, parent in model.named_modules():
        for attribute in QUANTIZED_PROJECTIONS:
            linear = getattr(parent, attribute, None)
            name = f"{parent_name}.{attribute}"
            if isinstance(linear, nn.Linear) and not any(name.startswith(s) or s in name for s in scheme.skipped):
                yield parent, attribute, linear


def empty_fp8_linears(model: nn.Module, scheme: Fp8Scheme) -> nn.Module:
    """Swap each quantized projection for an empty `Fp8Linear` (an FP8 checkpoint then fills it)."""
    for parent, attribute, linear in list(fp8_modules(model, scheme)):
        with torch.device(linear.weight.device):
            fp8 = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, scheme.block, linear.weight.dtype)
        setattr(parent, attribute, fp8)
    return model


@torch.no_grad()
def quantize_linears(model: nn.Module, whole_amax: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> nn.Module:
    """`--quantization fp8`: each loaded projection quantized per output row, in place of its float weight.
    whole_amax(projection, amax [N, 1]): each row's amax over the whole weight, where a rank holds
    some of its columns (tensor parallelism: `TensorParallel.whole_amax`)."""
    for parent, attribute, linear in list(fp8_modules(model, Fp8Scheme())):
        with torch.device(linear.weight.device):
            fp8 = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, None, linear.weight.dtype)
        amax = None if whole_amax is None else whole_amax(attribute, linear.weight.abs().amax(dim=-1, keepdim=True))
        fp8.weight.data, fp8.weight_scale.data = quantize_weight_rows(linear.weight, amax)
        if linear.bias is not None:
            fp8.bias.data = linear.bias.detach()
        setattr(parent, attribute, fp8)
    return model
