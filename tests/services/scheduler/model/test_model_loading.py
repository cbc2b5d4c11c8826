"""Loader: weight sources, strict names, error messages, deterministic dummy weights, the bundled tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.models import RANDOM_TINY_MODEL
from services.scheduler.model.config import UnsupportedModelError
from services.scheduler.model.loader import (
    MissingTensorError,
    NoWeightsError,
    UnexpectedTensorError,
    _random_tensor,
    load_model_runner,
)


def test_missing_tensor_names_tensor_and_directory(hf_model_dir) -> None:
    _, path = hf_model_dir("qwen3", True)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingTensorError) as excinfo:
        load_model_runner(path, num_kv_blocks=4)
    assert "model.layers.1.mlp.up_proj.weight" in str(excinfo.value)
    assert str(path) in str(excinfo.value)


def rewrite_checkpoint(path: Path, change) -> Path:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_an_unconsumed_tensor_is_refused_by_name(hf_model_dir) -> None:
    # An extra bias (a checkpoint of another variant) would otherwise be dropped and serve wrong.
    _, path = hf_model_dir("qwen3", True)
    rewrite_checkpoint(path, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}))
    with pytest.raises(UnexpectedTensorError, match=r"'model.layers.0.self_attn.o_proj.bias' \(model.safetensors\)"):
        load_model_runner(path, num_kv_blocks=4)


def test_a_quantization_scale_is_refused_by_name(hf_model_dir) -> None:
    _, path = hf_model_dir("llama", False)
    scale = {"model.layers.1.mlp.down_proj.weight_scale_inv": torch.ones(1, 1)}
    rewrite_checkpoint(path, lambda t: t.update(scale))
    with pytest.raises(UnexpectedTensorError, match="weight_scale_inv"):
        load_model_runner(path, num_kv_blocks=4)


def test_a_float8_weight_is_refused(hf_model_dir) -> None:
    _, path = hf_model_dir("llama", False)
    name = "model.layers.0.mlp.up_proj.weight"
    rewrite_checkpoint(path, lambda t: t.update({name: t[name].to(torch.float8_e4m3fn)}))
    with pytest.raises(UnexpectedTensorError, match=f"'{name}'.*F8_E4M3"):
        load_model_runner(path, num_kv_blocks=4)


def test_harmless_extras_load(hf_model_dir, make_pager) -> None:
    # rotary_emb.inv_freq (recomputed here) and a tied model's copy of its embedding as lm_head.weight
    model, path = hf_model_dir("qwen2", True)
    def add(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    rewrite_checkpoint(path, add)
    runner = load_model_runner(path, num_kv_blocks=4, kv_block_size=4)
    torch.testing.assert_close(runner.lm_head_weight, model.model.embed_tokens.weight.detach())


def test_an_untied_models_head_is_not_an_extra(hf_model_dir) -> None:
    _, path = hf_model_dir("qwen2", True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(MissingTensorError, match="lm_head.weight"):
        load_model_runner(path, num_kv_blocks=4)


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    config = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 8, "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="DeepseekV3ForCausalLM") as excinfo:
        load_model_runner(tmp_path, load_format="dummy")
    assert all(name in str(excinfo.value) for name in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Gemma2ForCausalLM"))


def test_directory_without_weights_suggests_dummy(tmp_path: Path) -> None:
    config = json.loads((RANDOM_TINY_MODEL / "config.json").read_text())
    del config["sparkwire_weights"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NoWeightsError, match="--load-format dummy"):
        load_model_runner(tmp_path, num_kv_blocks=4)


def test_dummy_weights_depend_only_on_seed(tmp_path: Path) -> None:
    a = load_model_runner(RANDOM_TINY_MODEL, load_format="dummy", seed=3, num_kv_blocks=4)
    b = load_model_runner(RANDOM_TINY_MODEL, load_format="dummy", seed=3, num_kv_blocks=4)
    c = load_model_runner(RANDOM_TINY_MODEL, load_format="dummy", seed=4, num_kv_blocks=4)
    for (name, pa), pb, pc in zip(a.model.named_parameters(), b.model.parameters(), c.model.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_large_dummy_tensor_is_deterministic_and_spread() -> None:
    shape = torch.Size([2001, 2001])  # above the repetition period
    first = _random_tensor("x.weight", shape, 0, torch.device("cpu"))
    assert first.shape == shape and torch.equal(first, _random_tensor("x.weight", shape, 0, torch.device("cpu")))
    assert 0.015 < float(first.std()) < 0.025
    assert not torch.equal(first[0], first[1])


def test_seeded_random_bundled_model_is_deterministic() -> None:
    a = load_model_runner(RANDOM_TINY_MODEL, num_kv_blocks=4)
    b = load_model_runner(RANDOM_TINY_MODEL, load_format="dummy", seed=a.config.sparkwire_seed, num_kv_blocks=4)
    assert a.config.sparkwire_weights == "seeded-random"
    assert torch.equal(a.lm_head_weight, b.lm_head_weight)


def test_bundled_model_runs_and_shares_embeddings(make_pager) -> None:
    runner = load_model_runner(RANDOM_TINY_MODEL, num_kv_blocks=8, kv_block_size=16)
    assert (runner.block_size, runner.num_blocks, runner.dtype) == (16, 8, torch.float32)
    ids = torch.tensor([5, 17, 300, 2])
    pager = make_pager(num_seqs=1, max_blocks_per_seq=8, block_size=16)
    out = runner.forward(pager.batch([(0, ids.tolist(), 0)]))
    logits = runner.compute_logits(out.hidden_states)
    assert logits.shape == (4, runner.config.vocab_size) and torch.isfinite(logits).all()
    assert runner.lm_head_weight is runner.model.model.embed_tokens.weight  # tied
    torch.testing.assert_close(runner.embed_tokens(ids), runner.lm_head_weight[ids])


def test_default_kv_cache_fits_budget() -> None:
    runner = load_model_runner(RANDOM_TINY_MODEL, kv_cache_bytes=10 * 2**20, kv_block_size=16)
    assert runner.kv_cache.kv.numel() * 4 <= 10 * 2**20
    assert runner.num_blocks == 10 * 2**20 // (4 * 2 * 16 * 2 * 32 * 4) - 1  # one is the trash block


def test_rejects_unknown_load_format() -> None:
    with pytest.raises(ValueError, match="load_format"):
        load_model_runner(RANDOM_TINY_MODEL, load_format="pt")
