"""Logits of the paged runtime against Hugging Face transformers on tiny random models (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.model.loader import load_model_runner

TOL = 1e-4
CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", True), ("qwen3", False)]


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [S, V]


def prompt(length: int, seed: int, vocab: int = 384) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(("family", "tie"), CASES)
def test_full_prefill_matches_reference(hf_model_dir, make_pager, family: str, tie: bool) -> None:
    model, path = hf_model_dir(family, tie, sharded=family != "qwen3")
    ids = prompt(37, seed=1)
    pager = make_pager(num_seqs=1, max_blocks_per_seq=16, block_size=4)
    runner = load_model_runner(path, num_kv_blocks=pager.num_blocks, kv_block_size=4)
    out = runner.forward(pager.batch([(0, ids, 0)]))
    logits = runner.compute_logits(out.hidden_states)
    assert logits.shape == (37, 384) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference_logits(model, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize(("family", "tie"), [("llama", False), ("qwen2", True), ("qwen3", True)])
def test_ragged_mixed_batch_matches_reference(hf_model_dir, make_pager, family: str, tie: bool) -> None:
    """Step 2 mixes a second prefill chunk, a one-token decode and a 4-token verify block."""
    model, path = hf_model_dir(family, tie)
    seqs = [prompt(40, seed=2), prompt(13, seed=3), prompt(14, seed=4)]
    pager = make_pager(num_seqs=3, max_blocks_per_seq=12, block_size=4)
    runner = load_model_runner(path, num_kv_blocks=pager.num_blocks, kv_block_size=4)
    first = [(0, seqs[0][:20], 0), (1, seqs[1][:12], 0), (2, seqs[2][:10], 0)]
    runner.forward(pager.batch(first))
    second = [(0, seqs[0][20:], 20), (1, seqs[1][12:], 12), (2, seqs[2][10:], 10)]
    logits = runner.compute_logits(runner.forward(pager.batch(second)).hidden_states)  # [20 + 1 + 4, V]
    expected = torch.cat([reference_logits(model, s)[start:] for s, (_, _, start) in zip(seqs, second)])
    torch.testing.assert_close(logits, expected, atol=TOL, rtol=0)


def greedy_generate(runner, pager, ids: list[int], num_new: int) -> list[int]:
    """Test-only decode loop: prefill, then one token per step; sequence 0 owns its blocks."""
    hidden = runner.forward(pager.batch([(0, ids, 0)])).hidden_states
    tokens = list(ids)
    for _ in range(num_new):
        tokens.append(int(runner.compute_logits(hidden[-1:]).argmax(-1)))
        hidden = runner.forward(pager.batch([(0, tokens[-1:], len(tokens) - 1)])).hidden_states
    return tokens[len(ids) :]


@pytest.mark.parametrize(("family", "tie"), [("llama", False), ("qwen2", False), ("qwen3", True)])
def test_greedy_generation_matches_hf_generate(hf_model_dir, make_pager, family: str, tie: bool) -> None:
    model, path = hf_model_dir(family, tie)
    ids = prompt(9, seed=11)
    pager = make_pager(num_seqs=1, max_blocks_per_seq=20, block_size=4)
    runner = load_model_runner(path, num_kv_blocks=pager.num_blocks, kv_block_size=4)
    ours = greedy_generate(runner, pager, ids, 64)
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
    assert len(set(expected)) >= 8  # a reference stuck on one token would prove little
    assert ours == expected


def test_capture_layers_returns_chosen_layer_outputs(hf_model_dir, make_pager) -> None:
    model, path = hf_model_dir("qwen3", True)
    ids = prompt(11, seed=6)
    pager = make_pager(num_seqs=1, max_blocks_per_seq=4, block_size=4)
    runner = load_model_runner(path, num_kv_blocks=pager.num_blocks, kv_block_size=4)
    out = runner.forward(pager.batch([(0, ids, 0)], capture_layers=(1, 0)))
    assert out.captured is not None and out.captured.shape == (11, 2 * 64)
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [L + 1] x [1, S, H]
    expected = torch.cat([states[2][0], states[1][0]], dim=-1)
    torch.testing.assert_close(out.captured, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_capture_layer_minus_one_is_the_embedding_output(hf_model_dir, make_pager, family: str) -> None:
    model, path = hf_model_dir(family, True)
    ids = prompt(9, seed=8)
    pager = make_pager(num_seqs=1, max_blocks_per_seq=4, block_size=4)
    runner = load_model_runner(path, num_kv_blocks=pager.num_blocks, kv_block_size=4)
    out = runner.forward(pager.batch([(0, ids, 0)], capture_layers=(-1, 1)))
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [L + 1] x [1, S, H]
    torch.testing.assert_close(out.captured, torch.cat([states[0][0], states[2][0]], dim=-1), atol=TOL, rtol=0)


def test_no_capture_returns_none(hf_model_dir, make_pager) -> None:
    _, path = hf_model_dir("llama", False)
    pager = make_pager(num_seqs=1, max_blocks_per_seq=4, block_size=4)
    runner = load_model_runner(path, num_kv_blocks=pager.num_blocks, kv_block_size=4)
    assert runner.forward(pager.batch([(0, prompt(5, seed=7), 0)])).captured is None


def test_equal_shape_prefills_share_one_attention_call(hf_model_dir, make_pager) -> None:
    """Two fresh 18-token prefills, then two 17-token chunks after them: both pairs batch together."""
    model, path = hf_model_dir("qwen3", False)
    seqs = [prompt(35, seed=8), prompt(35, seed=9), prompt(3, seed=10)]
    pager = make_pager(num_seqs=3, max_blocks_per_seq=10, block_size=4)
    runner = load_model_runner(path, num_kv_blocks=pager.num_blocks, kv_block_size=4)
    first = runner.forward(pager.batch([(0, seqs[0][:18], 0), (1, seqs[1][:18], 0), (2, seqs[2], 0)]))
    second = runner.forward(pager.batch([(1, seqs[1][18:], 18), (0, seqs[0][18:], 18)]))
    logits = runner.compute_logits(torch.cat([first.hidden_states, second.hidden_states]))
    ref = [reference_logits(model, s) for s in seqs]
    expected = torch.cat([ref[0][:18], ref[1][:18], ref[2], ref[1][18:], ref[0][18:]])
    torch.testing.assert_close(logits, expected, atol=TOL, rtol=0)
