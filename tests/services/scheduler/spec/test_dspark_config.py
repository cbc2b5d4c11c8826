"""DSpark draft config.json (DeepSpec layout): parsing, the gamma mapping, validation against the target."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.scheduler.model.config import ModelConfig, UnsupportedModelError
from services.scheduler.spec.dspark_config import DraftConfigError, DSparkConfig, default_target_layer_ids

REPO = Path(__file__).resolve().parents[4]
# A DeepSpec-style draft config for Qwen3-4B's shape, as its trainer writes one (target config + fields).
DEEPSPEC_4B = {
    "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "layer_types": ["full_attention"] * 5, "block_size": 7, "mask_token_id": 151669,
    "target_layer_ids": [1, 9, 17, 25, 33], "num_target_layers": 36, "num_anchors": 512, "markov_rank": 256,
    "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
}  # fmt: skip
QWEN3_4B_TARGET = {**DEEPSPEC_4B, "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 36}


def test_a_deepspec_config_parses_with_gamma_equal_to_block_size():
    config = DSparkConfig.from_dict(DEEPSPEC_4B)
    assert config.num_draft_tokens == config.block_size == 7  # 7 drafts, verify width 8
    assert config.target_layer_ids == (1, 9, 17, 25, 33) and config.num_context_layers == 5
    assert config.backbone.num_hidden_layers == 5 and config.backbone.qk_norm
    assert config.markov_rank == 256 and config.confidence_uses_markov
    config.check_target(ModelConfig.from_dict(QWEN3_4B_TARGET))


def test_to_dict_round_trips():
    config = DSparkConfig.from_dict(DEEPSPEC_4B)
    assert DSparkConfig.from_dict(config.to_dict()) == config and "sparkwire_context_window" not in config.to_dict()
    windowed = DSparkConfig.from_dict({**DEEPSPEC_4B, "sparkwire_context_window": 4096})
    assert windowed.context_window == 4096 and DSparkConfig.from_dict(windowed.to_dict()) == windowed


def test_published_drafts_see_the_whole_context_and_the_bundled_one_its_training_length():
    from ops.train.recipes import DRAFTERS

    assert DSparkConfig.from_dict(DEEPSPEC_4B).context_window is None
    bundled = DSparkConfig.from_pretrained(REPO / "ops" / "models" / "sparkwire-micro-dspark")
    assert bundled.context_window == DRAFTERS["micro"].seq_len == 256


def test_default_target_layers_are_spread_from_1_to_l_minus_3():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # DeepSpec's Qwen3-4B draft
    assert default_target_layer_ids(36, 2) == (1, 33)
    assert default_target_layer_ids(6, 2) == (1, 3)
    assert default_target_layer_ids(36, 1) == (18,)


def test_the_8b_benchmark_draft_config_fits_the_8b_target():
    draft = DSparkConfig.from_pretrained(REPO / "ops" / "model_configs" / "Qwen3-8B-dspark")
    draft.check_target(ModelConfig.from_pretrained(REPO / "ops" / "model_configs" / "Qwen3-8B"))
    assert draft.block_size == 7 and draft.target_layer_ids == default_target_layer_ids(36, 5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["Qwen3ForCausalLM"]}, "architectures must be"),
        ({"mask_token_id": 151936}, "mask_token_id 151936 is outside the vocabulary"),
        ({"target_layer_ids": [1, 9, 36]}, r"out of range \[-1, 35\]"),
        ({"target_layer_ids": [-2, 9]}, r"out of range \[-1, 35\]"),
        ({"target_layer_ids": [9, -1]}, "strictly increasing"),
        ({"target_layer_ids": [9, 1]}, "strictly increasing"),
        ({"target_layer_ids": []}, "must not be empty"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"markov_rank": -1}, "markov_rank must be >= 0"),
        ({"markov_rank": 0}, "confidence_head_with_markov needs a Markov head"),
        ({"sparkwire_context_window": 0}, "sparkwire_context_window must be >= 1"),
    ],
)
def test_malformed_configs_are_refused_with_the_reason(change, message):
    with pytest.raises(DraftConfigError, match=message):
        DSparkConfig.from_dict({**DEEPSPEC_4B, **change})


def test_minus_one_names_the_embedding_output_as_deepspec_allows():
    assert DSparkConfig.from_dict({**DEEPSPEC_4B, "target_layer_ids": [-1, 9, 17]}).target_layer_ids == (-1, 9, 17)


def test_a_missing_field_is_named():
    raw = {key: value for key, value in DEEPSPEC_4B.items() if key != "mask_token_id"}
    with pytest.raises(DraftConfigError, match="lacks 'mask_token_id'"):
        DSparkConfig.from_dict(raw)


def test_an_unsupported_markov_head_type_is_refused():
    with pytest.raises(UnsupportedModelError, match="markov_head_type 'lstm'"):
        DSparkConfig.from_dict({**DEEPSPEC_4B, "markov_head_type": "lstm"})


@pytest.mark.parametrize(
    ("target_change", "message"),
    [
        ({"num_hidden_layers": 28}, r"num_target_layers \(36\) != the target's num_hidden_layers \(28\)"),
        ({"hidden_size": 4096}, r"draft hidden_size \(2560\) != target hidden_size \(4096\)"),
        ({"vocab_size": 151000}, "vocab_size"),
    ],
)
def test_a_draft_that_does_not_fit_the_target_is_refused(target_change, message):
    config = DSparkConfig.from_dict(DEEPSPEC_4B)
    with pytest.raises(DraftConfigError, match=message):
        config.check_target(ModelConfig.from_dict({**QWEN3_4B_TARGET, **target_change}))


def test_mask_token_must_lie_inside_the_target_vocabulary():
    config = DSparkConfig.from_dict(DEEPSPEC_4B)  # mask 151669
    with pytest.raises(DraftConfigError, match="mask_token_id 151669 >= the target's vocab_size 151600"):
        config.check_target(ModelConfig.from_dict({**QWEN3_4B_TARGET, "vocab_size": 151600}))


def test_specforge_nested_fields_are_read():
    raw = {key: value for key, value in DEEPSPEC_4B.items() if key not in ("target_layer_ids", "mask_token_id")}
    raw["dflash_config"] = {"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669}
    assert DSparkConfig.from_dict(raw) == DSparkConfig.from_dict(DEEPSPEC_4B)


def test_other_conventions_and_layer_kinds_are_refused():
    with pytest.raises(UnsupportedModelError, match="speculators convention"):
        DSparkConfig.from_dict({**DEEPSPEC_4B, "speculators_model_type": "dspark"})
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        DSparkConfig.from_dict({**DEEPSPEC_4B, "layer_types": ["full_attention", "sliding_attention"] * 2 + ["full_attention"]})
