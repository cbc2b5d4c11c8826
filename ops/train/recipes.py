"""The training recipes: model shapes and optimisation settings, one frozen dataclass each.

`micro` is the committed bundled pair (≤ 10 MB together in bf16, fast on 2 CPU cores); `large`
is the 30–100M-parameter target for GPU benchmarks, never committed; `toy` exists so CI can run
every script end to end in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TargetRecipe:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seq_len: int  # tokens per training window
    batch_size: int  # windows per step
    steps: int
    lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    rope_theta: float = 10000.0
    eval_every: int = 250  # steps between held-out loss points on the curve
    eval_windows: int = 64

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError("warmup_steps must be in [0, steps)")


@dataclass(frozen=True)
class DrafterRecipe:
    num_layers: int
    block_size: int  # γ: draft tokens per block (the anchor's slot predicts first)
    num_target_features: int  # K target layers whose hidden states feed the drafter
    markov_rank: int
    seq_len: int
    batch_size: int
    anchors_per_seq: int
    steps: int
    lr: float
    warmup_steps: int
    distill_fraction: float  # share of training sequences whose continuation the target wrote
    distill_prompt_len: int
    distill_new_tokens: int
    target_layer_ids: tuple[int, ...] | None = None  # None: spread evenly (dspark_config's default)
    pool_reuse: int = 8  # each self-distilled sequence is drawn about this often
    weight_decay: float = 0.0
    eval_every: int = 250
    eval_windows: int = 64

    def __post_init__(self) -> None:
        if not 0.0 <= self.distill_fraction <= 1.0:
            raise ValueError("distill_fraction must be in [0, 1]")
        if self.distill_fraction and self.distill_prompt_len + self.distill_new_tokens != self.seq_len:
            raise ValueError("self-distilled sequences must be seq_len long: prompt + new tokens")


TARGETS = {
    # 3.4M parameters: 6.8 MB in bf16.
    "micro": TargetRecipe(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                          head_dim=64, seq_len=512, batch_size=64, steps=3000, lr=2e-3, warmup_steps=150),
    # 46.9M parameters (1,500 steps fit one GPU call beside the micro drafter).
    "large": TargetRecipe(hidden_size=640, intermediate_size=1792, num_layers=10, num_heads=10, num_kv_heads=2,
                          head_dim=64, seq_len=512, batch_size=64, steps=1500, lr=1e-3, warmup_steps=150),
    "toy": TargetRecipe(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=16, seq_len=32, batch_size=4, steps=4, lr=1e-2, warmup_steps=1, eval_every=2,
                        eval_windows=4),
}  # fmt: skip

# The drafter's layers take the target's shapes (it shares the target's embedding and LM head).
DRAFTERS = {
    # 1.51M parameters: 3.0 MB in bf16 (9.85 MB with the target). A 4-layer target has no room for
    # 1..L-3: layers 1-3 feed it. Chosen by a sweep on one H200 (model card): 2 layers with Markov
    # rank 16 (1.51M) beat 1 layer with rank 32 (1.05M) or 64 (1.31M), accept 4.32 against 3.25, 3.44.
    "micro": DrafterRecipe(num_layers=2, block_size=7, num_target_features=3, target_layer_ids=(1, 2, 3),
                           markov_rank=16, seq_len=256, batch_size=64, anchors_per_seq=48, steps=5000, lr=2e-3,
                           warmup_steps=100, distill_fraction=0.75, distill_prompt_len=64, distill_new_tokens=192),
    "large": DrafterRecipe(num_layers=2, block_size=7, num_target_features=3, markov_rank=128, seq_len=256,
                           batch_size=64, anchors_per_seq=48, steps=2000, lr=1e-3, warmup_steps=100,
                           distill_fraction=0.75, distill_prompt_len=64, distill_new_tokens=192),
    "toy": DrafterRecipe(num_layers=1, block_size=4, num_target_features=2, target_layer_ids=(0, 1), markov_rank=4,
                         seq_len=16, batch_size=4, anchors_per_seq=4, steps=3, lr=1e-2, warmup_steps=1,
                         distill_fraction=0.5, distill_prompt_len=8, distill_new_tokens=8, eval_every=2,
                         eval_windows=4),
}  # fmt: skip
