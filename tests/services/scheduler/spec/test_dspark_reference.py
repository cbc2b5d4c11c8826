"""The drafter against an independent float64 reference of the published math (DeepSpec's
Qwen3DSparkModel as its paper and code describe it), written with per-head loops from the
checkpoint's named tensors: guards what the serving and training paths share (RoPE, q/k norms,
GQA head mapping, KV injection, Markov and confidence heads) against a common mistake."""

from __future__ import annotations

import torch

ANCHOR = 7
SEQ_LEN = 12


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D], rotate-half RoPE: pairs (i, i + D/2) turn by position * theta^(-2i/D)."""
    half = x.shape[-1] // 2
    angle = positions[:, None].double() * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def reference_block(drafter, hidden, ids, anchor):
    """-> (logits [gamma, V], confidence logits [gamma]) for one anchor, teacher-forced prev."""
    w = {name: t.detach().double() for name, t in drafter.checkpoint_tensors()}
    config, backbone = drafter.config, drafter.config.backbone
    eps, theta, d = backbone.rms_norm_eps, backbone.rope_theta, backbone.head_dim
    heads, kv_heads, gamma = backbone.num_attention_heads, backbone.num_key_value_heads, config.block_size
    embed = drafter.target.embed_tokens.weight.detach().double()
    context = rms(hidden[:anchor].double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [a, H]
    x = embed[torch.tensor([int(ids[anchor])] + [config.mask_token_id] * (gamma - 1))]  # [gamma, H]
    ctx_pos, blk_pos = torch.arange(anchor), torch.arange(anchor, anchor + gamma)
    for i in range(backbone.num_hidden_layers):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"], eps)

        def keys(rows, positions, p=p):
            k = rms((rows @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, d), w[p + "self_attn.k_norm.weight"], eps)
            return rotate(k, positions, theta), (rows @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, d)

        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(gamma, heads, d), w[p + "self_attn.q_norm.weight"], eps)
        q = rotate(q, blk_pos, theta)
        (k_ctx, v_ctx), (k_blk, v_blk) = keys(context, ctx_pos), keys(h, blk_pos)
        k, v = torch.cat((k_ctx, k_blk)), torch.cat((v_ctx, v_blk))  # every block query sees all of them
        out = torch.stack([
            torch.softmax(q[:, head] @ k[:, head * kv_heads // heads].T / d**0.5, dim=-1) @ v[:, head * kv_heads // heads]
            for head in range(heads)
        ], dim=1)  # fmt: skip  # [gamma, heads, D]
        x = x + out.reshape(gamma, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    final = rms(x, w["norm.weight"], eps)
    prev = ids[anchor : anchor + gamma]  # prev_k = the true token at a + k
    w1 = w["markov_head.markov_w1.weight"][prev]  # [gamma, r]
    logits = final @ drafter.target.lm_head_weight.detach().double().T + w1 @ w["markov_head.markov_w2.weight"].T
    features = torch.cat((final, w1), dim=-1)
    confidence = features @ w["confidence_head.proj.weight"][0] + w["confidence_head.proj.bias"]
    return logits, confidence


def test_training_forward_matches_the_float64_reference(drafter):
    width = drafter.config.num_context_layers * drafter.config.hidden_size
    hidden = torch.randn(SEQ_LEN, width, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 60, (SEQ_LEN,), generator=torch.Generator().manual_seed(1))
    out = drafter.forward_train(hidden[None], ids[None], torch.tensor([[ANCHOR]]))
    logits, confidence = reference_block(drafter, hidden, ids, ANCHOR)
    torch.testing.assert_close(out.logits[0, 0].double(), logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.confidence[0, 0].double(), confidence, atol=1e-4, rtol=1e-4)
