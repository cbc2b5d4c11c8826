"""RoPE scaling (`rope.py`) against transformers' own functions (`modeling_rope_utils.ROPE_INIT_FUNCTIONS`):
each type's inverse frequencies and attention factor, from the same config.json dict."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.model.config import ModelConfig, UnsupportedModelError
from services.scheduler.model.llama import rope_parameters
from services.scheduler.model.rope import rope_cos_sin

SHAPE = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
LONGROPE = {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + i for i in range(8)]}
# (architecture, config keys, the sequence length transformers computes for: None is its init)
CASES = {
    "linear": ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, None),
    "dynamic": ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, None),
    "llama3": ("LlamaForCausalLM", {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}, None),  # fmt: skip
    "yarn": ("Qwen3ForCausalLM", {"rope_scaling": YARN}, None),
    "yarn-mscale": ("Qwen3ForCausalLM", {"rope_scaling": {**YARN, "mscale": 0.8, "mscale_all_dim": 0.5}}, None),
    "yarn-options": ("Qwen3ForCausalLM", {"rope_scaling": {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False,
                     "attention_factor": 1.2}}, None),  # fmt: skip
    "longrope-long": ("Phi3ForCausalLM", {"rope_scaling": LONGROPE, "original_max_position_embeddings": 32,
                      "pad_token_id": 0}, 513),  # fmt: skip
}


def transformers_rope(architecture: str, keys: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**SHAPE, **keys)
    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, None, seq_len=seq_len)


@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_and_attention_factor_equal_transformers(case: str) -> None:
    architecture, keys, seq_len = CASES[case]
    ours = rope_parameters(ModelConfig.from_dict({"architectures": [architecture], **SHAPE, **keys}))
    want_inv_freq, want_factor = transformers_rope(architecture, keys, seq_len)
    torch.testing.assert_close(ours[0], want_inv_freq.float(), atol=0, rtol=1e-6)
    assert ours[1] == pytest.approx(want_factor, rel=1e-12)


def test_scaled_types_differ_from_the_default() -> None:
    # The comparisons above would hold for a type read as "default" if it changed nothing here.
    default = rope_parameters(ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **SHAPE}))[0]
    for case in ("linear", "llama3", "yarn", "longrope-long"):
        architecture, keys, _ = CASES[case]
        inv_freq = rope_parameters(ModelConfig.from_dict({"architectures": [architecture], **SHAPE, **keys}))[0]
        assert not torch.allclose(inv_freq, default), case


def test_longrope_takes_the_short_factors_when_served_within_the_original_context() -> None:
    architecture, keys, _ = CASES["longrope-long"]
    raw = {"architectures": [architecture], **SHAPE, **keys}
    short = rope_parameters(ModelConfig.from_dict(raw, context_len=32))
    want = transformers_rope(architecture, keys, None)  # transformers' init: the short factors
    torch.testing.assert_close(short[0], want[0].float(), atol=0, rtol=1e-6)
    assert short[1] == pytest.approx(want[1])
    long = rope_parameters(ModelConfig.from_dict(raw, context_len=33))[0]
    assert not torch.allclose(short[0], long)


def test_phi3_reads_su_as_longrope_and_prefers_the_top_level_original_length() -> None:
    raw = {"architectures": ["Phi3ForCausalLM"], **SHAPE, "original_max_position_embeddings": 32,
           "rope_scaling": {**LONGROPE, "type": "su", "original_max_position_embeddings": 64}}  # fmt: skip
    scaling = ModelConfig.from_dict(raw).rope_scaling
    assert (scaling.rope_type, scaling.original_max_position_embeddings) == ("longrope", 32)


def test_dynamic_is_refused_past_max_position_embeddings() -> None:
    raw = {"architectures": ["LlamaForCausalLM"], **SHAPE, **CASES["dynamic"][1]}
    assert ModelConfig.from_dict(raw, context_len=512).served_len == 512
    with pytest.raises(UnsupportedModelError, match="dynamic.*512.*513"):
        ModelConfig.from_dict(raw, context_len=513)


def test_longrope_factor_lists_must_cover_half_the_head() -> None:
    raw = {"architectures": ["Phi3ForCausalLM"], **SHAPE, "original_max_position_embeddings": 32,
           "rope_scaling": {**LONGROPE, "long_factor": [1.0] * 7}}  # fmt: skip
    with pytest.raises(ValueError, match="long_factor"):
        ModelConfig.from_dict(raw)


def test_attention_factor_scales_cos_and_sin_before_rounding() -> None:
    inv_freq = torch.tensor([1.0, 0.1])
    positions = torch.tensor([0, 3])
    plain = rope_cos_sin(inv_freq, positions, torch.float32)
    scaled = rope_cos_sin(inv_freq, positions, torch.float32, 1.25)
    torch.testing.assert_close(scaled[0], plain[0] * 1.25)
    torch.testing.assert_close(scaled[1], plain[1] * 1.25)
