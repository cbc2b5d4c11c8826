"""Loading and saving DSpark drafters; the worker's path: a runner, its captured layers, inject, propose."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.scheduler.model import ForwardBatch, MissingTensorError, NoWeightsError, UnexpectedTensorError, load_model_runner
from services.scheduler.spec.base import ContextRows, DraftRequest
from services.scheduler.spec.dspark_loader import WEIGHTS_FILE, load_drafter, load_dspark_proposer, save_drafter
from tests.services.scheduler.spec.conftest import TARGET_CONFIG


def load_like(target, target_config, path, **options):
    return load_drafter(path, target.model.embed_tokens, target.lm_head_weight, target_config, **options)


def same_weights(a, b) -> bool:
    theirs = dict(b.checkpoint_tensors())
    return all(torch.equal(tensor, theirs[name]) for name, tensor in a.checkpoint_tensors())


def test_save_then_load_round_trips_without_the_target_tensors(tmp_path, drafter, target, target_config):
    save_drafter(drafter, tmp_path)
    loaded = load_like(target, target_config, tmp_path)
    assert loaded.config == drafter.config and same_weights(loaded, drafter)
    with safe_open(str(tmp_path / WEIGHTS_FILE), framework="pt") as handle:
        names = set(handle.keys())
    assert names == {name for name, _ in drafter.checkpoint_tensors()}
    assert "layers.0.mlp.gate_proj.weight" in names and not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]


def test_a_deepspec_checkpoint_with_its_embedding_and_lm_head_copies_loads(tmp_path, drafter, target, target_config):
    tensors = {name: t.detach().clone() for name, t in drafter.checkpoint_tensors()}
    tensors["embed_tokens.weight"] = torch.zeros_like(target.model.embed_tokens.weight)  # ignored: the target's are used
    tensors["lm_head.weight"] = torch.zeros_like(target.lm_head_weight)
    (tmp_path / "config.json").write_text(json.dumps(drafter.config.to_dict()))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_like(target, target_config, tmp_path)
    assert same_weights(loaded, drafter)
    assert loaded.target.lm_head_weight is target.lm_head_weight


def test_a_tensor_the_drafter_does_not_consume_is_refused_by_name(tmp_path, drafter, target, target_config):
    tensors = {name: t.detach().clone() for name, t in drafter.checkpoint_tensors()}
    tensors["layers.0.self_attn.o_proj.bias"] = torch.zeros(drafter.config.hidden_size)  # the drafter has none
    (tmp_path / "config.json").write_text(json.dumps(drafter.config.to_dict()))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnexpectedTensorError, match="'layers.0.self_attn.o_proj.bias'"):
        load_like(target, target_config, tmp_path)


def test_a_missing_tensor_is_named(tmp_path, drafter, target, target_config):
    tensors = {n: t.detach().clone() for n, t in drafter.checkpoint_tensors() if not n.startswith("confidence_head.")}
    (tmp_path / "config.json").write_text(json.dumps(drafter.config.to_dict()))  # enables the confidence head
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(MissingTensorError, match="confidence_head.proj"):
        load_like(target, target_config, tmp_path)


def test_dummy_weights_are_seeded(tmp_path, drafter, target, target_config):
    (tmp_path / "config.json").write_text(json.dumps(drafter.config.to_dict()))
    first, again, other = (load_like(target, target_config, tmp_path, load_format="dummy", seed=s) for s in (3, 3, 4))
    assert same_weights(first, again) and not same_weights(first, other)
    with pytest.raises(NoWeightsError, match="--load-format dummy"):
        load_like(target, target_config, tmp_path)
    with pytest.raises(ValueError, match="load_format"):
        load_like(target, target_config, tmp_path, load_format="pt")


def test_the_worker_path_runner_capture_inject_propose_matches_training(tmp_path, drafter):
    """What the model worker does: capture the draft's layers in a target forward, inject every row,
    propose from the sampled token; the drafts equal the training forward on the same hidden states."""
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(TARGET_CONFIG))
    save_drafter(drafter, draft_dir)
    runner = load_model_runner(target_dir, load_format="dummy", num_kv_blocks=16, kv_block_size=4, seed=5)
    proposer = load_dspark_proposer(draft_dir, runner)
    ids, table = torch.randint(0, 60, (10,), generator=torch.Generator().manual_seed(0)), [3, 7, 1]
    slots = torch.tensor(table)[torch.arange(10) // 4] * 4 + torch.arange(10) % 4
    batch = ForwardBatch(
        input_ids=ids, positions=torch.arange(10), query_start_loc=torch.tensor([0, 10], dtype=torch.int32),
        seq_lens=torch.tensor([10], dtype=torch.int32), block_tables=torch.tensor([table], dtype=torch.int32),
        slot_mapping=slots, capture_layers=proposer.capture_layers,
    )  # fmt: skip
    captured = runner.forward(batch).captured  # [10, K*H]
    proposer.inject(ContextRows(hidden=captured, positions=batch.positions, slots=slots))
    anchor = torch.tensor([41])  # the token sampled after the prompt, at position 10
    proposal = proposer.propose(DraftRequest(("r",), anchor, torch.tensor([10]), batch.block_tables, 10, (0.0,), (0,)))
    teacher = torch.cat((ids, anchor, proposal.tokens[0, :-1]))  # prev_k = the drafts
    hidden = torch.cat((captured, torch.zeros(len(teacher) - 10, captured.shape[1])))
    logits = proposer.drafter.forward_train(hidden[None], teacher[None], torch.tensor([[10]])).logits[0, 0]
    assert torch.equal(logits.argmax(-1), proposal.tokens[0])


def test_a_recurrent_markov_head_round_trips(tmp_path, draft_config, target, target_config):
    import dataclasses

    from tests.services.scheduler.spec.conftest import random_drafter

    drafter = random_drafter(dataclasses.replace(draft_config, markov_head_type="rnn"), target, seed=8)
    save_drafter(drafter, tmp_path)
    loaded = load_like(target, target_config, tmp_path)
    assert loaded.config.markov_head_type == "rnn" and same_weights(loaded, drafter)
    assert "markov_head.joint_proj.weight" in dict(loaded.checkpoint_tensors())


def test_the_drafters_memory_is_known_before_the_target_loads():
    """`drafter_memory` (counted on the meta device) is what the loaded drafter holds: its weights,
    and its KV cache per block."""
    from services.models import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL
    from services.scheduler.model import ModelConfig
    from services.scheduler.spec.dspark_loader import drafter_memory

    reserve = drafter_memory(BUNDLED_DRAFT_MODEL, ModelConfig.from_pretrained(BUNDLED_MODEL), torch.float32, 16)
    runner = load_model_runner(BUNDLED_MODEL, num_kv_blocks=8, kv_block_size=16)
    proposer = load_dspark_proposer(BUNDLED_DRAFT_MODEL, runner)
    assert reserve.weight_bytes == sum(p.numel() * p.element_size() for p in proposer.drafter.parameters()) > 0
    draft_kv = proposer.kv_cache.kv
    assert reserve.bytes_per_block == draft_kv.numel() * draft_kv.element_size() // (8 + 1)  # + the trash block


def test_dspark_scheduler_fits_both_kv_caches_in_its_budget():
    """kv_cache_bytes holds the target's and the drafter's KV caches together, not the target's alone."""
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.build import build_core

    budget = 4 * 2**20
    plain = build_core(SchedulerConfig(device="cpu", kv_cache_bytes=budget)).worker.runner
    core = build_core(SchedulerConfig(speculative_algorithm="dspark", device="cpu", kv_cache_bytes=budget))
    target, draft = core.worker.runner.kv_cache.kv, core.worker.proposer.kv_cache.kv
    used = target.numel() * target.element_size() + draft.numel() * draft.element_size()
    assert used <= budget < used * 1.1  # the whole budget, less its rounding to blocks
    assert core.worker.runner.num_blocks < plain.num_blocks


def test_the_served_drafter_attends_to_its_configured_window_unless_the_flag_says_otherwise():
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.build import build_core

    def served_window(**options) -> int | None:
        return build_core(SchedulerConfig(speculative_algorithm="dspark", device="cpu", kv_cache_bytes=2**20, **options)).worker.proposer.context_window

    assert served_window() == 256  # the bundled drafter's sparkwire_context_window: its training length
    assert served_window(draft_context_window=64) == 64
    assert served_window(draft_context_window=0) is None  # the whole context


def test_cuda_kv_budget_leaves_the_drafters_weights_out():
    from services.scheduler.model.loader import MemoryReserve, cuda_kv_budget

    assert cuda_kv_budget(100 * 2**30, 0.8, MemoryReserve()) == int(80 * 2**30)
    assert cuda_kv_budget(100 * 2**30, 0.8, MemoryReserve(weight_bytes=10 * 2**30)) == int(72 * 2**30)
    assert cuda_kv_budget(2**30, 0.8, MemoryReserve(weight_bytes=2**31)) == 0
    assert cuda_kv_budget(100 * 2**30, 0.8, MemoryReserve(weight_bytes=8 * 2**30, step_bytes=2 * 2**30)) == int(72 * 2**30)


def test_the_drafters_reserve_holds_its_steps_vocabulary_wide_tensors_at_the_running_limit():
    """At the Qwen3-8B shape (V 151,936, gamma 7, bf16) and 64 running requests a DSpark step holds
    ~1.4 GiB of [rows, V] tensors (CPU, measured: ops/bench/results/serve.md), which the KV budget
    used to leave to the fraction's headroom; the reserve now counts them from the shapes."""
    from services.models import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL
    from services.scheduler.model import ModelConfig
    from services.scheduler.spec.dspark_config import DSparkConfig
    from services.scheduler.spec.dspark_loader import draft_step_bytes, drafter_memory

    target = ModelConfig.from_pretrained(BUNDLED_MODEL)
    none, some = (drafter_memory(BUNDLED_DRAFT_MODEL, target, torch.bfloat16, 16, max_rows=rows) for rows in (0, 64))
    gamma = DSparkConfig.from_pretrained(BUNDLED_DRAFT_MODEL).block_size
    assert none.step_bytes == 0 and some.weight_bytes == none.weight_bytes
    assert some.step_bytes == draft_step_bytes(64, gamma, target.vocab_size, torch.bfloat16) == 64 * draft_step_bytes(1, gamma, target.vocab_size, torch.bfloat16)
    assert 1.3 * 2**30 < draft_step_bytes(64, 7, 151_936, torch.bfloat16) < 1.6 * 2**30
