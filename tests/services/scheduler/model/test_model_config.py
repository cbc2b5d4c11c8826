"""ModelConfig parsing: both config dialects, family flags and options (from published configs), refusals,
eos ids, the published Qwen3 shapes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.scheduler.model.config import FULL, SLIDING, ModelConfig, RopeScaling, UnsupportedModelError
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
    with pytest.raises(UnsupportedModelError, match="'mrope'"):
        parse("Qwen2ForCausalLM", rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})


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


# ---- the families of issue 42, from excerpts of their published config.json files ----

GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], **BASE, "num_hidden_layers": 6, "head_dim": 256,
             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256,
             "sliding_window": 4096, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
             "rope_theta": 10000.0, "cache_implementation": "hybrid"}  # fmt: skip
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], **BASE, "num_hidden_layers": 7, "head_dim": 256,
             "sliding_window": 512, "sliding_window_pattern": 6, "rope_local_base_freq": 10000, "rope_theta": 1000000,
             "rope_scaling": None, "query_pre_attn_scalar": 256, "attn_logit_softcapping": None,
             "final_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip


def test_mistral_and_phi3_slide_every_layer_when_the_config_has_a_window() -> None:
    mistral = parse("MistralForCausalLM", sliding_window=4096)
    assert mistral.layer_types == (SLIDING, SLIDING) and [mistral.layer_window(i) for i in (0, 1)] == [4096, 4096]
    assert parse("MistralForCausalLM", sliding_window=None).layer_types == ()  # v0.2+: none
    phi3 = parse("Phi3ForCausalLM", sliding_window=2047, max_position_embeddings=4096)  # Phi-3-mini-4k
    assert phi3.layer_window(1) == 2047 and not phi3.attention_bias


def test_qwen_sliding_window_follows_max_window_layers_as_transformers_does() -> None:
    off = parse("Qwen2ForCausalLM", use_sliding_window=False, sliding_window=131072, max_window_layers=28)  # Qwen2.5
    assert off.layer_types == () and off.layer_window(0) == 0
    on = parse("Qwen3ForCausalLM", num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert on.layer_types == (FULL, FULL, SLIDING, SLIDING) and on.layer_window(3) == 64


def test_gemma2_options() -> None:
    config = ModelConfig.from_dict(GEMMA2_9B)
    assert config.layer_types == (SLIDING, FULL) * 3 and config.sliding_window == 4096
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.scale == 256**-0.5 and config.hidden_act == "gelu_pytorch_tanh" and not config.qk_norm
    assert config.tie_word_embeddings and config.local_rope_theta is None


def test_gemma3_options() -> None:
    config = ModelConfig.from_dict(GEMMA3_1B)
    assert config.layer_types == (SLIDING,) * 5 + (FULL, SLIDING)
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling) == (1e6, 10000.0, None)
    assert config.qk_norm and config.attn_logit_softcap is None and config.final_logit_softcap is None
    nested = {**GEMMA3_1B, "rope_theta": None, "rope_local_base_freq": None, "rope_scaling": None,
              "rope_parameters": {FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                  SLIDING: {"rope_type": "default", "rope_theta": 10000.0}}}  # fmt: skip
    config = ModelConfig.from_dict(nested)  # transformers >= 5 writes it nested by layer type
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling.rope_type) == (1e6, 10000.0, "linear")


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method 'awq'"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq'"),
        ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, "activation_scheme 'static'"),
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
    ],
)
def test_refused_with_one_line(keys, message) -> None:
    with pytest.raises(UnsupportedModelError, match=message) as refused:
        parse("Qwen3ForCausalLM", **keys)
    assert "\n" not in str(refused.value)


def test_gemma_encoder_mode_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        ModelConfig.from_dict({**GEMMA3_1B, "use_bidirectional_attention": True})


def test_every_architecture_has_a_network_and_every_network_a_config_row() -> None:
    from services.scheduler.model.config import ARCHITECTURES
    from services.scheduler.model.registry import MODEL_CLASSES

    assert set(MODEL_CLASSES) == set(ARCHITECTURES)
