"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral, the shared decoder (`llama.py`) with a
sparse MLP in place of the dense one.

Each token's router logits [T, E] pick its top-k experts; the kept probabilities are
    w_j = softmax(logits)[e_j]                      (Qwen3-MoE, norm_topk_prob false)
    w_j = softmax(logits)[e_j] / sum_i softmax(logits)[e_i]   (Mixtral always; Qwen3-MoE with norm_topk_prob)
in fp32, as transformers computes them, and the layer's output is sum_j w_j * expert_{e_j}(x), each
expert a SwiGLU MLP. Qwen3-MoE keeps dense MLPs on `mlp_only_layers` and off every
`decoder_sparse_step`-th layer (`ModelConfig.dense_layers`).

The experts run as one grouped computation over (token, expert) pairs: on CUDA the fused Triton
kernel of `triton_moe.py` (pairs sorted by expert into blocks, a grouped GEMM for gate/up and one
for down, capacity sized from the batch, so CUDA graphs capture it), elsewhere `experts_reference`
(the twin: one matmul per expert that got a token). The weights live as [E, 2I, H] and [E, H, I]
stacks; each checkpoint tensor (`experts.{e}.gate_proj.weight`, Mixtral's `w1`/`w3`/`w2`) fills a
slice of them. DSpark reads the residual stream after each layer, as for dense models.

FP8 experts (`to_fp8`): the stacks in float8_e4m3fn with fp32 scales, per tile ([E, 2I / bn, H / bk],
a block-wise checkpoint's `experts.{e}.gate_proj.weight_scale_inv`, gate's tiles above up's) or per
row ([E, 2I], `weight_scale`, or `--quantization fp8`'s, `quantize_experts`). The Triton kernel
reads them as they are (W8A16: each FP8 tile upcast to the activations' dtype, its scale applied to
the tile's fp32 dot), the twin dequantizes the stacks (`fp8.dequantize`) and runs as above.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.fp8 import FP8, Fp8Scheme, dequantize, quantize_weight_rows, scale_shape
from services.scheduler.model.kv_cache import PagedKVCache
from services.scheduler.model.llama import MLP, CausalLM, DecoderLayer, Plan, Ropes, add_rms_norm, norm_linear, silu_mul


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights fp32 [T, k], expert ids int64 [T, k]): the top-k of the fp32
    softmax, renormalized to sum to 1 where the family does."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_j weights[t, j] * down[e](SiLU(gate) * up) for x [T, H], gate_up [E, 2I, H], down [E, H, I],
    weights/ids [T, k] -> [T, H]: one matmul per expert hit (a host sync: the CPU twin)."""
    num_tokens, top_k = ids.shape
    flat = ids.flatten()  # [T k], pair p is (token p // k, choice p % k)
    pair_out = x.new_zeros(num_tokens * top_k, x.shape[1])  # [T k, H]
    for expert in flat.unique().tolist():
        pairs = (flat == expert).nonzero().squeeze(1)  # [n]
        hidden = silu_mul(F.linear(x[pairs // top_k], gate_up[expert]))  # [n, I]
        pair_out[pairs] = F.linear(hidden, down[expert])
    return combine(pair_out, weights)


def combine(pair_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Pair outputs [T k, H] weighted by the router [T, k] (fp32) and summed per token -> [T, H] in pair_out's dtype
    (transformers rounds Qwen3-MoE's weights to the model's dtype first: in bf16 the two differ by that rounding)."""
    num_tokens, top_k = weights.shape
    weighted = pair_out.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)  # fp32 [T, k, H]
    return weighted.sum(dim=1).to(pair_out.dtype)


class Experts(nn.Module):
    """E SwiGLU experts as two weight stacks; `names`: the checkpoint's (gate, up, down) per expert."""

    names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, inter, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))  # [E, 2I, H]: [gate | up] rows
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))  # [E, H, I]
        self.intermediate_size = inter

    block: tuple[int, int] | None = None  # FP8 stacks: their scales' tile (None: one scale per row)

    @property
    def quantized(self) -> bool:
        return self.gate_up_proj.dtype == FP8

    def to_fp8(self, block: tuple[int, int] | None) -> None:
        """Hold both stacks as empty FP8 with their fp32 scales (`gate_up_proj_scale`, `down_proj_scale`)."""
        if block is not None and self.intermediate_size % block[0]:
            raise ValueError(f"block-wise FP8 experts need moe_intermediate_size ({self.intermediate_size}) a multiple of {block[0]}")
        self.block = block
        for name in ("gate_up_proj", "down_proj"):
            stack = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(stack.shape, dtype=FP8, device=stack.device), requires_grad=False))
            scale = torch.empty(scale_shape(stack.shape, block), device=stack.device)
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def checkpoint_slices(self) -> Iterator[tuple[str, torch.Tensor]]:
        gate, up, down = self.names
        scale_rows = self.intermediate_size // (self.block[0] if self.block else 1)
        scale_name = "weight_scale" if self.block is None else "weight_scale_inv"
        for expert in range(self.gate_up_proj.shape[0]):
            gate_part, up_part = self.gate_up_proj[expert].split(self.intermediate_size, dim=0)
            yield f"experts.{expert}.{gate}.weight", gate_part
            yield f"experts.{expert}.{up}.weight", up_part
            yield f"experts.{expert}.{down}.weight", self.down_proj[expert]
            if self.quantized:
                gate_scale, up_scale = self.gate_up_proj_scale[expert].split(scale_rows, dim=0)
                yield f"experts.{expert}.{gate}.{scale_name}", gate_scale
                yield f"experts.{expert}.{up}.{scale_name}", up_scale
                yield f"experts.{expert}.{down}.{scale_name}", self.down_proj_scale[expert]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, fused: bool = False) -> torch.Tensor:
        # On CUDA the kernel even with the fused small ops off: the twin syncs the host, which graphs cannot capture.
        if fused or x.is_cuda:
            from services.scheduler.model.triton_moe import fused_experts

            scales = (self.gate_up_proj_scale, self.down_proj_scale, self.block) if self.quantized else None
            return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids, scales)
        if self.quantized:
            gate_up = dequantize(self.gate_up_proj, self.gate_up_proj_scale, self.block, x.dtype)
            down = dequantize(self.down_proj, self.down_proj_scale, self.block, x.dtype)
            return experts_reference(x, gate_up, down, weights, ids)
        return experts_reference(x, self.gate_up_proj, self.down_proj, weights, ids)


def empty_fp8_experts(model: nn.Module, scheme: Fp8Scheme) -> nn.Module:
    """Every expert stack as empty FP8 in the checkpoint's layout (a block-wise or per-row FP8 checkpoint fills it)."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.to_fp8(scheme.block)
    return model


@torch.no_grad()
def quantize_experts(model: nn.Module) -> nn.Module:
    """`--quantization fp8`: each expert stack quantized per row (amax / 448), as `fp8.quantize_linears` does projections."""
    for module in model.modules():
        if isinstance(module, Experts) and not module.quantized:
            stacks = {name: quantize_weight_rows(getattr(module, name)) for name in ("gate_up_proj", "down_proj")}
            module.to_fp8(None)
            for name, (q, scale) in stacks.items():
                getattr(module, name).data, getattr(module, f"{name}_scale").data = q, scale
    return model


class MixtralExperts(Experts):
    names = ("w1", "w3", "w2")


class SparseMoE(nn.Module):
    """Router + experts: [T, H] -> [T, H]. `gate` is the router (the checkpoint's name)."""

    experts_class: type[Experts] = Experts

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = self.experts_class(config)
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob

    def checkpoint_slices(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.experts.checkpoint_slices()

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)  # [T, k] each
        return self.experts(x, weights, ids, fused)


class MixtralMoE(SparseMoE):
    experts_class = MixtralExperts


class MoeDecoderLayer(DecoderLayer):
    moe_class: type[SparseMoE] = SparseMoE

    def make_mlp(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return MLP(config) if layer_index in config.dense_layers else self.moe_class(config)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ropes: Ropes, batch: ForwardBatch,
        cache: PagedKVCache, plan: Plan, fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `DecoderLayer.forward`; a sparse MLP takes the normed stream whole (no gate_up to fuse the norm with).
        Under tensor parallelism each rank's experts hold their intermediate block: one all-reduce sums them."""
        if not isinstance(self.mlp, SparseMoE):
            return super().forward(x, residual, ropes, batch, cache, plan, fused)
        qkv, residual = norm_linear(x, residual, self.input_layernorm, self.self_attn.qkv_proj, fused)
        x = self.self_attn(qkv, ropes, batch, cache, plan, fused)
        if self.tp is not None:
            x = self.tp.all_reduce(x)
        normed, residual = add_rms_norm(x, residual, self.post_attention_layernorm, fused)
        x = self.mlp(normed, fused)
        return (x if self.tp is None else self.tp.all_reduce(x)), residual


class MixtralDecoderLayer(MoeDecoderLayer):
    moe_class = MixtralMoE


class MoeForCausalLM(CausalLM):
    """Qwen3-MoE: the sparse layers' tensors under `mlp.` (the stacks filled through their slices)."""

    layer_class = MoeDecoderLayer
    block_name = "mlp"  # the checkpoint's name for a layer's sparse block

    def checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super().checkpoint_tensors():
            if ".experts.gate_up_proj" in name or ".experts.down_proj" in name:
                continue  # the stacks: their slices come by expert
            yield name.replace(".mlp.", f".{self.block_name}."), tensor


class MixtralForCausalLM(MoeForCausalLM):
    layer_class = MixtralDecoderLayer
    block_name = "block_sparse_moe"
