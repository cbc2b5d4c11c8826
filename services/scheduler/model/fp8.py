"""FP8 weights: the decoder's projections (q/k/v, o, gate/up, down) as float8_e4m3fn with fp32 scales.

Three layouts, one module (`Fp8Linear`), dequantized as W = W8 * scale:
- block-wise (`quantization_config.weight_block_size` [bn, bk], DeepSeek/Qwen3-FP8): one scale per
  bn x bk tile, shipped as `weight_scale_inv` [ceil(N / bn), ceil(K / bk)] (a multiplier, despite the name);
- per-tensor / per-channel (quant_method fp8 without a block size): `weight_scale`, one scalar or one
  per output row, held as one per row [N] so that fused q/k/v and gate/up keep each part's own;
- `--quantization fp8` (`quantize_linears`): a bf16 checkpoint's weights quantized at load, per row
  (amax / 448).
On CUDA (compute capability 8.9+, FP8 tensor cores) the projections are W8A8: activations are
quantized per token on the fly ("dynamic": a per-tensor static `input_scale` is refused at config
time), one fp32 scale per token and group of columns (`activation_group`: the weight's k tile for
block-wise weights, 128 columns for per-row ones inside the Triton kernel of `triton_fp8.py`, the
whole row on cuBLAS's row-scaled GEMM, `torch._scaled_mm`, which per-row weights take past
`DECODE_ROWS`). The same per-token quantization whatever the batch: a token's output does not
depend on the tokens beside it. `w8a8_reference` is that arithmetic in fp32 torch (the GPU check's
reference, ops/bench gpu-models). Elsewhere (CPU, older GPUs) the twin dequantizes the weight to the
activations' dtype and runs the plain linear (the CPU tests' reference).
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
# Steps of at most this many rows are decode-sized: the Triton kernels stream the weight (one token: a GEMV;
# more: tensor-core tiles split along K; `triton_fp8.tiles`). Past it, per-row weights take cuBLAS's
# row-scaled FP8 GEMM (`torch._scaled_mm`).
DECODE_ROWS = 64
ACTIVATION_GROUP = 128  # per-row weights in the Triton kernel: columns per activation scale
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
        scale = nn.Parameter(torch.empty(scale_shape(self.weight.shape, block)), requires_grad=False)  # fp32 [N] or [N / bn, K / bk]
        if block is None:
            self.weight_scale = scale
        else:
            self.weight_scale_inv = scale
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
        return dequantize(self.weight, self.scale, self.block, dtype)

    def on_cublas(self, num_rows: int) -> bool:
        return self.block is None and num_rows > DECODE_ROWS

    def activation_group(self, num_rows: int) -> int:
        """Columns per activation scale on the FP8 path for a step of `num_rows` tokens."""
        if self.on_cublas(num_rows):
            return self.in_features
        return ACTIVATION_GROUP if self.block is None else self.block[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fp8_matmul_available(x.device):
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        if self.on_cublas(x.numel() // x.shape[-1]):
            out = scaled_mm_rows(x, self.weight, self.weight_scale)
        else:
            from services.scheduler.model.triton_fp8 import fp8_linear

            out = fp8_linear(x, self.weight, self.scale, self.block)
        return self.biased(out)

    def norm_gemv(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token on the W8A8 path: (self(norm_weight * rms_norm(x + residual)), x + residual) in one
        launch (`llama.norm_linear`'s fused step), the same bits as the norm kernel then `forward`."""
        from services.scheduler.model.triton_fp8 import fp8_norm_gemv

        out, summed = fp8_norm_gemv(x, residual, norm_weight, eps, self.weight, self.scale, self.block)
        return self.biased(out), summed

    def silu_gemv(self, gate_up: torch.Tensor) -> torch.Tensor:
        """One token on the W8A8 path: self(SiLU(gate) * up) of gate_up [1, 2K] in one launch
        (`llama.silu_linear`'s fused step), the same bits as the SiLU kernel then `forward`."""
        from services.scheduler.model.triton_fp8 import fp8_silu_gemv

        return self.biased(fp8_silu_gemv(gate_up, self.weight, self.scale, self.block))

    def biased(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.bias is None else out + self.bias

    @torch.no_grad()
    def w8a8_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The FP8 path's arithmetic in fp32: x [..., K] quantized per token and `activation_group`
        columns as the path quantizes it, times the weight dequantized -> [..., N] fp32."""
        flat = x.reshape(-1, self.in_features)
        group = self.activation_group(flat.shape[0])
        x_q, x_scale = quantize_groups(flat, group)
        x_dequantized = x_q.float() * x_scale.repeat_interleave(group, dim=1)[:, : self.in_features]  # [M, K]
        out = x_dequantized @ self.dequantized(torch.float32).T
        out = out if self.bias is None else out + self.bias.float()
        return out.view(*x.shape[:-1], -1)


def fp8_matmul_available(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA compute capability 8.9 (Ada) or later."""
    return device.type == "cuda" and _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # a fixed property of the card: asked once, not per layer


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], fp32 scales [M, ceil(K / group)]) with x ~= q * scale, one scale per row
    and `group` columns (amax / 448; a last, shorter group where group does not divide K)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    grouped = F.pad(x.float(), (0, groups * group - cols)).view(rows, groups, group)
    scale = grouped.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [M, K / group]
    q = (grouped / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, groups * group)
    return q[:, :cols], scale


def scaled_mm_rows(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) times FP8 weight [N, K] with per-row weight scales [N] -> [M, N] in x's dtype."""
    x_q, x_scale = quantize_groups(x.reshape(-1, x.shape[-1]), x.shape[-1])  # one scale per row [M, 1]
    out_dtype = x.dtype if x.dtype != torch.float32 else torch.bfloat16  # row-wise _scaled_mm writes 16-bit
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.float().view(1, -1), out_dtype=out_dtype)
    return out.to(x.dtype).view(*x.shape[:-1], -1)


@torch.no_grad()
def quantize_weight_rows(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., N, K] -> (FP8 [..., N, K], fp32 per-row scales [..., N]): `--quantization fp8`.
    amax [N, 1]: each row's, given where the weight holds a part of each row (a row-parallel rank's)."""
    if amax is not None:
        scale = amax.float().clamp(min=1e-12) / FP8_MAX  # [N, 1]
        return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.squeeze(1)
    q, scale = quantize_groups(weight.reshape(-1, weight.shape[-1]), weight.shape[-1])
    return q.view(weight.shape), scale.view(weight.shape[:-1])


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """W8 [..., N, K] times its scales (per row [..., N], or per tile [..., N / bn, K / bk]) in fp32, rounded once to dtype."""
    scale = scale.float()
    if block is None:
        return (weight.float() * scale.unsqueeze(-1)).to(dtype)
    rows, cols = weight.shape[-2:]
    full = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * full).to(dtype)


def scale_shape(shape: torch.Size, block: tuple[int, int] | None) -> tuple[int, ...]:
    """The fp32 scales of an FP8 weight [..., N, K]: [..., N] per row, [..., N / bn, K / bk] per tile."""
    *lead, rows, cols = shape
    return (*lead, rows) if block is None else (*lead, -(-rows // block[0]), -(-cols // block[1]))


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
