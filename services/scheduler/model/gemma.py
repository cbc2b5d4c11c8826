"""Gemma 2 and Gemma 3 (text): the shared decoder (`llama.py`) with Gemma's layer.

What differs from Llama, as transformers' Gemma2/Gemma3 modules compute it:
- the embedding is scaled by sqrt(hidden), the scale rounded to the weights' dtype first;
- RMSNorm multiplies by (1 + weight) in fp32 and rounds once (`GemmaRMSNorm`), also on Gemma 3's
  per-head q/k norms; the fused Triton norms compute Llama's rounding, so these stay on torch ops
  (in the deterministic mode, on the row norm kernel, which computes Gemma's too: `llama.norm_rows`);
- each layer has four norms: the attention output and the MLP output are normed before they join
  the residual stream ("sandwich" norms);
- the MLP is GeGLU with tanh-GELU; scores are scaled by query_pre_attn_scalar ** -0.5;
- Gemma 2 soft-caps attention scores (cap * tanh(s / cap), in every attention path) and the final
  logits (`CausalLM.head_logits`); sliding-window layers alternate with global ones (Gemma 2: every
  other layer, Gemma 3: five of six, with their own RoPE base, `rope_local_base_freq`).

DSpark: the drafter reads the target's embedding module and head (`dspark_loader`), so it gets the
embedding scaled and the logits soft-capped, as the target's own rows are: its block inputs are what
the target's first layer sees, and its q is on the scale of the target's p. Soft-capping is monotone,
so greedy drafts are unchanged by it; sampled drafts are drawn from a q that, like p, cannot put a
logit past the cap. The captured layers are the residual stream after each layer, as for Llama.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.kv_cache import PagedKVCache
from services.scheduler.model.llama import Attention, CausalLM, DecoderLayer, Plan, Ropes, add_rms_norm, norm_rows


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in fp32, rounded once to x's dtype; the weight starts at 0."""

    fusable = False  # triton_fused's fused norms multiply the weight after rounding, Llama's way
    unit_offset = True  # the row kernel's Gemma rounding (`llama.norm_rows`)
    row_kernel = False  # `batch_invariant.set_batch_invariant`: each row by triton_fused's norm kernel

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_kernel:
            return norm_rows(x, self)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """The token embedding times sqrt(hidden), the scale rounded to the weight's dtype as transformers does."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = embedding_dim**0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # a host scalar, rounded on the host: no device tensor is made (CUDA graphs capture this)
        rounded = torch.tensor(self.scale, dtype=torch.float32).to(self.weight.dtype).item()
        return super().forward(input_ids) * rounded


class GemmaAttention(Attention):
    norm_class = GemmaRMSNorm  # Gemma 3's q/k norms


class GemmaDecoderLayer(DecoderLayer):
    attention_class = GemmaAttention
    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ropes: Ropes, batch: ForwardBatch,
        cache: PagedKVCache, plan: Plan, fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (the normed MLP output, the stream before it), as `DecoderLayer`: the
        sublayer outputs are normed before they are added."""
        normed, stream = add_rms_norm(x, residual, self.input_layernorm)  # [T, H] each
        attended = self.self_attn(self.self_attn.qkv_proj(normed), ropes, batch, cache, plan, fused)
        stream = stream + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(stream), fused)
        return self.post_feedforward_layernorm(mlp_out), stream


class GemmaForCausalLM(CausalLM):
    layer_class = GemmaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size)
