"""Tiny fp32 DSpark fixtures: a random Qwen3 target (6 layers, vocab 64) and a 2-layer drafter for it."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.model.config import ModelConfig
from services.scheduler.model.llama import CausalLM
from services.scheduler.model.loader import fill_random_weights
from services.scheduler.spec.dspark_config import DSparkConfig, draft_config_for_target
from services.scheduler.spec.dspark_model import DSparkDrafter

TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "eos_token_id": 2,
}
MASK_TOKEN_ID = 63
BLOCK_SIZE = 4  # gamma
WEIGHT_STD_SCALE = 20.0  # the 0.02 dummy init gives near-uniform drafts; this makes them decisive


@pytest.fixture(scope="session")
def target_config() -> ModelConfig:
    return ModelConfig.from_dict(TARGET_CONFIG)


@pytest.fixture(scope="session")
def target(target_config) -> CausalLM:
    model = CausalLM(target_config)
    fill_random_weights(model, seed=0)
    return model.eval()


@pytest.fixture(scope="session")
def draft_config(target_config) -> DSparkConfig:
    return draft_config_for_target(
        target_config, num_draft_layers=2, mask_token_id=MASK_TOKEN_ID, block_size=BLOCK_SIZE, markov_rank=8
    )


def random_drafter(config: DSparkConfig, target: CausalLM, seed: int) -> DSparkDrafter:
    drafter = DSparkDrafter(config, target.model.embed_tokens, target.lm_head_weight)
    fill_random_weights(drafter, seed)
    with torch.no_grad():
        for name, param in drafter.checkpoint_tensors():
            if not name.endswith("norm.weight"):
                param.mul_(WEIGHT_STD_SCALE)
    return drafter.eval()


@pytest.fixture(scope="session")
def drafter(draft_config, target) -> DSparkDrafter:
    return random_drafter(draft_config, target, seed=1)
