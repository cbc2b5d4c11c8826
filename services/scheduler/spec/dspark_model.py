"""The DSpark drafter network (DFlash backbone + Markov head + confidence head) and its training forward.

Math, for one block drafted from anchor token x_a at position a (gamma = block_size slots):

    context   c_t = RMSNorm(fc([h^(l1)_t ; ... ; h^(lK)_t]))        t < a, the target's K layer outputs
    keys      every draft layer l projects c_t with its own k/v projections (k-norm, RoPE at t):
              the context's keys/values ("KV injection"; no query, no MLP ever runs on c_t)
    block     e = embed([x_a, mask, ..., mask]) at positions a .. a + gamma - 1 (the target's embedding)
    layers    Qwen3 layers (q/k RMSNorm, RoPE); each block query attends to the context keys at
              positions < a and to all gamma block keys (non-causal inside the block)
    logits    z_k = lm_head(RMSNorm(h_k))                             the target's LM head, k = 0..gamma-1
    Markov    q_k = softmax((z_k + W2 W1[prev_k]) / T),  prev_0 = x_a,  prev_k = d_k (the draft at slot k-1)
              (variants: "gated" W2 (sigmoid(G[h_k ; W1[prev_k]]) * W1[prev_k]); "rnn" a recurrent state
              over the block, see RecurrentMarkovHead)
    confidence c_k = sigmoid(w . [RMSNorm(h_k) ; W1[prev_k]] + b)     (W1 part only with_markov)

Slot k predicts the token at position a + k + 1. Serving (`dspark.DSparkProposer`) runs this with
the context read from a paged KV cache and prev_k = the token it just drafted; training runs it
densely with prev_k teacher-forced (the true token at a + k):

    forward_train(target_hidden [B, S, K*H], input_ids [B, S], anchor_positions [B, A])
        -> DraftTrainOutput(logits f32 [B, A, gamma, V] (Markov-corrected, before temperature),
                            confidence f32 [B, A, gamma] logits before the sigmoid, or None)
    draft_targets(input_ids, anchor_positions, gamma) -> (labels [B, A, gamma], valid [B, A, gamma])

`target_hidden[b, t]` is the concatenation of the K target layers' outputs (pre final norm, in
`target_layer_ids` order) at position t: what `CausalLM.forward` returns as `captured` with
`capture_layers = target_layer_ids`. Anchors may be any positions 0..S-1; a block whose labels run
past S-1 is simply masked by `valid`. Both paths share every function below, so serving logits equal
training logits for the same inputs (tests/services/scheduler/spec/test_dspark_model.py).

Parameter names follow DeepSpec's Qwen3DSparkModel (and SGLang's loader), see `dspark_loader`.
The embedding and LM head are the target's, held by reference and never registered as parameters:
`parameters()` and `state_dict()` hold only the drafter's own weights (what a trainer optimises and
a checkpoint stores).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.model.batch_invariant import Linear, has_triton, invariant_linear
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.llama import MLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq, rope_parameters, softcap
from services.scheduler.spec.dspark_config import DSparkConfig

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, D]
ContextKV = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # layer -> K, V [N, C, Hkv, D]


@dataclass(frozen=True)
class SharedTarget:
    """The target's modules the drafter uses; a plain holder so nn.Module does not register them."""

    embed_tokens: nn.Module  # [V, H] embedding (Gemma's: scaled by sqrt(H), as the target's own rows)
    lm_head_weight: torch.Tensor  # [V, H]
    # the target's final soft-cap (Gemma 2; `gemma.py` says why q takes it too); None: none
    logit_softcap: float | None = None


@dataclass(frozen=True)
class DraftTrainOutput:
    logits: torch.Tensor  # f32 [B, A, gamma, V], Markov-corrected
    confidence: torch.Tensor | None  # f32 [B, A, gamma], logits before the sigmoid


class DraftAttention(nn.Module):
    batch_invariant = False  # `set_batch_invariant`: each block's attention its own (`attend_block_rows`)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        )  # fmt: skip
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def key_value(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (context or block rows) -> K (normed, rotated), V, each [T, Hkv, D]."""
        k = self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        return apply_rope(k, *rope), self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, rope: Rope, context: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
        """x [N, Q, H]; context K, V [N, C, Hkv, D]; mask bool [N, 1, Q, C + Q] -> [N, Q, H]."""
        n, num_queries = x.shape[:2]
        flat = x.reshape(n * num_queries, x.shape[2])  # [N*Q, H]
        q = apply_rope(self.q_norm(self.q_proj(flat).view(-1, self.num_heads, self.head_dim)), *rope)
        block = tuple(t.view(n, num_queries, self.num_kv_heads, self.head_dim) for t in self.key_value(flat, rope))
        q = q.view(n, num_queries, self.num_heads, self.head_dim)
        if self.batch_invariant:
            out = attend_block_rows(q, context, block, mask)
        else:
            keys, values = (torch.cat((c, b), dim=1) for c, b in zip(context, block))  # [N, C + Q, Hkv, D]
            out = masked_attention(q, keys, values, mask)
        return self.o_proj(out.reshape(n, num_queries, self.num_heads * self.head_dim))


def attend_block_rows(
    q: torch.Tensor, context: tuple[torch.Tensor, ...], block: tuple[torch.Tensor, ...], mask: torch.Tensor
) -> torch.Tensor:
    """`masked_attention` of serving blocks (each block's queries see the same keys), each block's
    numbers its own whatever the batch: on CUDA the Triton kernel (`triton_draft_attention`),
    elsewhere one call per block over exactly the keys it sees. q [N, Q, Hq, D]; context K, V
    [N, C, Hkv, D]; block K, V [N, Q, Hkv, D]; mask bool [N, 1, Q, C + Q] -> [N, Q, Hq, D]."""
    seen = mask[:, 0, 0, : context[0].shape[1]]  # [N, C]
    scale = q.shape[-1] ** -0.5
    if q.is_cuda and has_triton():
        from services.scheduler.spec.triton_draft_attention import draft_attention_triton

        return draft_attention_triton(q, context, block, seen, scale)
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        keys, values = (torch.cat((c[b][seen[b]], k[b])).float() for c, k in zip(context, block))  # [L, Hkv, D], fresh
        out[b] = _attend_one_block(q[b], keys, values, scale)
    return out


def _attend_one_block(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, Hq, D] over keys, values [L, Hkv, D] (fp32), fp32 inside -> [Q, Hq, D] in q's dtype."""
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    grouped = q.to(torch.float32, copy=True).view(num_queries, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("qhgd,khd->hgqk", grouped, keys) * scale  # [Hkv, g, Q, L]
    out = torch.einsum("hgqk,khd->qhgd", scores.softmax(dim=-1), values)  # [Q, Hkv, g, D]
    return out.reshape(num_queries, num_heads, head_dim).to(q.dtype)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [N, Q, Hq, D]; k, v [N, K, Hkv, D]; mask bool [N, 1, Q, K] (True: visible) -> [N, Q, Hq, D].

    Query head h reads kv head h // g (g = Hq / Hkv, the Hugging Face GQA layout). The g query heads
    of a kv head ride along the query axis ([N, Hkv, g * Q, D]), so the context K/V is never copied
    g times. Every query sees at least its own block's keys, so no softmax row is empty.
    """
    n, num_queries, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    grouped = q.view(n, num_queries, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [N, Hkv, g, Q, D]
    grouped = grouped.reshape(n, num_kv_heads, group * num_queries, head_dim)
    grouped_mask = mask[:, :, None].expand(n, 1, group, num_queries, mask.shape[-1]).flatten(2, 3)  # [N, 1, g*Q, K]
    out = F.scaled_dot_product_attention(
        grouped, k.transpose(1, 2), v.transpose(1, 2), attn_mask=grouped_mask, scale=head_dim**-0.5
    )  # [N, Hkv, g * Q, D]
    out = out.view(n, num_kv_heads, group, num_queries, head_dim).permute(0, 3, 1, 2, 4)  # [N, Q, Hkv, g, D]
    return out.reshape(n, num_queries, num_heads, head_dim)


class DraftLayer(nn.Module):
    tp = None  # tensor_parallel.TensorParallel (`dspark_tp`): sums o_proj's and down_proj's partial outputs over ranks

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, context: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
        x = x + self._summed(self.self_attn(self.input_layernorm(x), rope, context, mask))
        return x + self._summed(self.mlp(self.post_attention_layernorm(x)))

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.tp is None else self.tp.all_reduce(partial)


class MarkovHead(nn.Module):
    """`vanilla`: a rank-r bigram correction of the draft logits, bias(prev) = W2 W1[prev].

    `step` serves one slot (carrying `state` for the recurrent variant); `block` computes all
    gamma slots of teacher-forced blocks at once. The same formula is behind both.
    """

    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # W1 [V, r]
        self.markov_w2 = Linear(rank, vocab_size, bias=False)  # W2: r -> V

    def latent(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)  # [..., r]

    def step(self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        """prev int64 [B], hidden [B, H] (final-normed) -> (bias f32 [B, V], next state)."""
        return self.markov_w2(self.latent(prev, hidden)).float(), None

    def block(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """prev int64 [..., gamma], hidden [..., gamma, H] -> bias f32 [..., gamma, V]."""
        return self.markov_w2(self.latent(prev, hidden)).float()


class GatedMarkovHead(MarkovHead):
    """`gated`: bias = W2 (sigmoid(G [h ; W1[prev]]) * W1[prev]), the slot's hidden state gating the bigram."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size, rank, hidden_size)
        self.gate_proj = Linear(hidden_size + rank, rank)

    def latent(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embedded = self.markov_w1(prev)
        return torch.sigmoid(self.gate_proj(torch.cat((hidden, embedded), dim=-1))) * embedded


class RecurrentMarkovHead(MarkovHead):
    """`rnn`: a gated recurrent state s over the block (s_0 = 0), bias_k = W2 tanh(o_k), where
    [g, c, o] = J [s_{k-1} ; W1[prev_k] ; h_k] and s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size, rank, hidden_size)
        self.joint_proj = Linear(2 * rank + hidden_size, 3 * rank)

    def step(self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        embedded = self.markov_w1(prev)  # [..., r]
        state = torch.zeros_like(embedded) if state is None else state
        gate, candidate, output = self.joint_proj(torch.cat((state, embedded, hidden), dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)).float(), state

    def block(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        biases, state = [], None
        for slot in range(prev.shape[-1]):
            bias, state = self.step(prev[..., slot], hidden[..., slot, :], state)
            biases.append(bias)
        return torch.stack(biases, dim=-2)


MARKOV_HEADS = {"vanilla": MarkovHead, "gated": GatedMarkovHead, "rnn": RecurrentMarkovHead}


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1).float()  # logit, [...]


class DSparkDrafter(nn.Module):
    tp = None  # tensor_parallel.TensorParallel where the drafter is sharded (`dspark_tp.shard_drafter`)

    def __init__(
        self, config: DSparkConfig, embed_tokens: nn.Module, lm_head_weight: torch.Tensor, logit_softcap: float | None = None
    ) -> None:
        super().__init__()
        backbone = config.backbone
        self.config = config
        self.target = SharedTarget(embed_tokens, lm_head_weight, logit_softcap)
        self.fc = Linear(config.num_context_layers * backbone.hidden_size, backbone.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(backbone.hidden_size, backbone.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(backbone) for _ in range(backbone.num_hidden_layers))
        self.norm = RMSNorm(backbone.hidden_size, backbone.rms_norm_eps)
        self.markov_head = None
        if config.markov_rank > 0:
            head = MARKOV_HEADS[config.markov_head_type]
            self.markov_head = head(backbone.vocab_size, config.markov_rank, backbone.hidden_size)
        self.confidence_head = None
        if config.enable_confidence_head:
            extra = config.markov_rank if config.confidence_uses_markov else 0
            self.confidence_head = ConfidenceHead(backbone.hidden_size + extra)
        self.register_buffer("rope_inv_freq", rope_inv_freq(backbone), persistent=False)
        self.rope_factor = rope_parameters(backbone)[1]  # YaRN's mscale where the backbone's RoPE has one

    @property
    def num_draft_tokens(self) -> int:
        return self.config.block_size

    def checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor a checkpoint holds, by its DeepSpec name (gate/up as row views of the fused MLP)."""
        for name, param in self.named_parameters():
            if ".mlp.gate_up_proj." not in name:
                yield name, param
        for index, layer in enumerate(self.layers):
            for name, part in layer.mlp.checkpoint_slices():
                yield f"layers.{index}.mlp.{name}", part

    # -- the steps both paths share -------------------------------------------------------------

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(target_hidden))  # [..., K*H] -> [..., H]

    def rope(self, positions: torch.Tensor) -> Rope:
        return rope_cos_sin(self.rope_inv_freq, positions.reshape(-1), self.fc.weight.dtype, self.rope_factor)  # [T, 1, D] each

    def context_key_values(self, context: torch.Tensor, positions: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
        """Projected context [T, H] at positions [T] -> each layer's injected K, V [T, Hkv, D]."""
        rope = self.rope(positions)
        for layer in self.layers:
            yield layer.self_attn.key_value(context, rope)

    def block_embeddings(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """anchor_tokens int64 [...] -> embeddings [..., gamma, H] of [anchor, mask x (gamma - 1)]."""
        ids = torch.full((*anchor_tokens.shape, self.num_draft_tokens), self.config.mask_token_id,
                         dtype=torch.int64, device=anchor_tokens.device)  # fmt: skip
        ids[..., 0] = anchor_tokens
        return self.target.embed_tokens(ids)

    def run_block(self, x: torch.Tensor, positions: torch.Tensor, context: ContextKV, mask: torch.Tensor) -> torch.Tensor:
        """x [N, Q, H] block embeddings at positions [N, Q]; mask [N, 1, Q, C + Q] -> final-normed [N, Q, H]."""
        rope = self.rope(positions)
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, context(index), mask)
        return self.norm(x)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        product = invariant_linear if getattr(self, "batch_invariant", False) else F.linear
        return softcap(product(hidden, self.target.lm_head_weight), self.target.logit_softcap).float()  # [..., V]

    def markov_step(self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None) -> tuple:
        """One serving slot's Markov bias ([B, V], or 0.0 without the head) and the head's next state."""
        return (0.0, None) if self.markov_head is None else self.markov_head.step(prev, hidden, state)

    def confidence_logit(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """hidden [..., H] (final-normed), prev int64 [...] -> logit [...] (None without the head)."""
        if self.confidence_head is None:
            return None
        if self.config.confidence_uses_markov:
            hidden = torch.cat((hidden, self.markov_head.markov_w1(prev).to(hidden.dtype)), dim=-1)
        return self.confidence_head(hidden)

    # -- training -------------------------------------------------------------------------------

    def forward_train(
        self, target_hidden: torch.Tensor, input_ids: torch.Tensor, anchor_positions: torch.Tensor
    ) -> DraftTrainOutput:
        """Dense teacher-forced forward of A blocks per sequence (see the module docstring)."""
        batch, seq_len = input_ids.shape
        num_anchors, gamma = anchor_positions.shape[1], self.num_draft_tokens
        context = self.project_context(target_hidden)  # [B, S, H]
        context_positions = torch.arange(seq_len, device=input_ids.device).repeat(batch)  # [B*S]
        layer_kv = [
            tuple(t.view(batch, seq_len, *t.shape[1:]) for t in kv)  # [B, S, Hkv, D]
            for kv in self.context_key_values(context.flatten(0, 1), context_positions)
        ]
        anchors = input_ids.gather(1, anchor_positions)  # [B, A]
        x = self.block_embeddings(anchors).flatten(1, 2)  # [B, A*gamma, H]
        positions = block_positions(anchor_positions, gamma).flatten(1)  # [B, A*gamma]
        mask = training_mask(anchor_positions, seq_len, gamma)  # [B, 1, A*gamma, S + A*gamma]
        hidden = self.run_block(x, positions, layer_kv.__getitem__, mask).view(batch, num_anchors, gamma, -1)
        prev = teacher_forced_prev(input_ids, anchor_positions, gamma)  # [B, A, gamma]
        logits = self.base_logits(hidden)  # [B, A, gamma, V]
        if self.markov_head is not None:
            logits = logits + self.markov_head.block(prev, hidden)
        return DraftTrainOutput(logits=logits, confidence=self.confidence_logit(hidden, prev))


def block_positions(anchor_positions: torch.Tensor, gamma: int) -> torch.Tensor:
    """int64 [...] -> [..., gamma]: a, a + 1, ..., a + gamma - 1."""
    return anchor_positions[..., None] + torch.arange(gamma, device=anchor_positions.device)


def training_mask(anchor_positions: torch.Tensor, seq_len: int, gamma: int) -> torch.Tensor:
    """bool [B, 1, A*gamma, S + A*gamma]: a query of block j sees context keys < anchor_j and block j's keys."""
    batch, num_anchors = anchor_positions.shape
    device = anchor_positions.device
    query_anchor = anchor_positions.repeat_interleave(gamma, dim=1)  # [B, Q]
    sees_context = torch.arange(seq_len, device=device)[None, None, :] < query_anchor[:, :, None]  # [B, Q, S]
    block_of = torch.arange(num_anchors, device=device).repeat_interleave(gamma)  # [Q]
    same_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)  # [B, Q, Q]
    return torch.cat((sees_context, same_block), dim=2)[:, None]


def teacher_forced_prev(input_ids: torch.Tensor, anchor_positions: torch.Tensor, gamma: int) -> torch.Tensor:
    """prev_k = the true token at a + k (clamped to the sequence; such slots have no label anyway)."""
    index = block_positions(anchor_positions, gamma).clamp_max(input_ids.shape[1] - 1)  # [B, A, gamma]
    return input_ids.gather(1, index.flatten(1)).view(index.shape)


def draft_targets(input_ids: torch.Tensor, anchor_positions: torch.Tensor, gamma: int) -> tuple[torch.Tensor, ...]:
    """(labels int64 [B, A, gamma], valid bool [B, A, gamma]): slot k's label is the token at a + k + 1."""
    index = block_positions(anchor_positions, gamma) + 1  # [B, A, gamma]
    valid = index < input_ids.shape[1]
    labels = input_ids.gather(1, index.clamp_max(input_ids.shape[1] - 1).flatten(1)).view(index.shape)
    return labels, valid
