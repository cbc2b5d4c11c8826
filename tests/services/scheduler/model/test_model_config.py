"""ModelConfig parsing: both config dialects, family flags, eos ids, the published Qwen3 shapes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.scheduler.model.config import ModelConfig, RopeScaling, UnsupportedModelError
from services.scheduler.model.kv_cache import PagedKVCache, bytes_per_block, num_blocks_for_budget

REPO = Path(__file__).resolve().parents[4]
BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4}


def parse(architecture: str, **extra) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": [architecture], **BASE, **extra})


def test_classic_llama3_rope_scaling() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = parse("LlamaForCausalLM", rope_theta=500000.0, rope_scaling=scaling)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def test_transformers5_rope_parameters() -> None:
    config = parse("Qwen3ForCausalLM", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert (config.rope_theta, config.rope_scaling) == (1e6, None)


def test_unsupported_rope_type() -> None:
    with pytest.raises(UnsupportedModelError, match="yarn"):
        parse("Qwen2ForCausalLM", rope_scaling={"type": "yarn", "factor": 4.0})


def test_family_flags() -> None:
    llama, qwen2, qwen3 = parse("LlamaForCausalLM"), parse("Qwen2ForCausalLM"), parse("Qwen3ForCausalLM")
    assert (llama.attention_bias, llama.o_proj_bias, llama.qk_norm) == (False, False, False)
    assert (qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.attention_bias, qwen3.qk_norm) == (False, True)
    assert llama.head_dim == 8 and llama.num_key_value_heads == 4


def test_eos_ids_merge_config_and_generation_config() -> None:
    config = ModelConfig.from_dict(
        {"architectures": ["Qwen3ForCausalLM"], **BASE, "eos_token_id": 5}, {"eos_token_id": [7, 5]}
    )
    assert config.eos_token_ids == (5, 7)


def test_bad_head_counts_rejected() -> None:
    with pytest.raises(ValueError, match="multiple"):
        parse("LlamaForCausalLM", num_key_value_heads=3)


@pytest.mark.parametrize(
    ("name", "hidden", "layers", "heads", "tie"),
    [("Qwen3-0.6B", 1024, 28, 16, True), ("Qwen3-1.7B", 2048, 28, 16, True), ("Qwen3-8B", 4096, 36, 32, False)],
)
def test_published_qwen3_shapes(name: str, hidden: int, layers: int, heads: int, tie: bool) -> None:
    config = ModelConfig.from_pretrained(REPO / "ops" / "model_configs" / name)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (hidden, layers, heads)
    assert (config.num_key_value_heads, config.head_dim, config.vocab_size) == (8, 128, 151936)
    assert config.tie_word_embeddings is tie and config.qk_norm and config.torch_dtype == "bfloat16"
    assert config.eos_token_ids == (151645, 151643) and config.intermediate_size == 3 * hidden


def test_kv_cache_sizing_and_slots() -> None:
    config = parse("Qwen3ForCausalLM", num_key_value_heads=2)
    per_block = bytes_per_block(config, 4, torch.float32)
    assert per_block == 2 * 2 * 4 * 2 * 8 * 4
    assert num_blocks_for_budget(config, 4, torch.float32, 10 * per_block + 1) == 10
    with pytest.raises(ValueError, match="no block"):
        num_blocks_for_budget(config, 4, torch.float32, per_block - 1)
    cache = PagedKVCache(config, 3, 4, torch.float32, torch.device("cpu"))
    key = torch.randn(2, 2, 8)
    cache.write(1, torch.tensor([9, 2]), key, -key)
    # Table [2, 0]: positions 0-3 live in block 2 (slot 9 is position 1), 4-7 in block 0 (slot 2 is position 6).
    read_k, read_v = cache.gather(1, torch.tensor([2, 0, -1]), 7)
    assert read_k.shape == (7, 2, 8)
    torch.testing.assert_close(read_k[1], key[0])
    torch.testing.assert_close(read_v[6], -key[1])


def test_tokenizer_build_is_deterministic(tmp_path: Path) -> None:
    script = REPO / "ops" / "models" / "build_tiny_tokenizer.py"
    for out in ("a", "b"):
        subprocess.run([sys.executable, str(script), "--out", str(tmp_path / out)], check=True, capture_output=True)
    for name in ("tokenizer.json", "config.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
