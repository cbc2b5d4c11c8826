"""Mixtures of experts (moe.py) through the scheduler core against transformers (issue 42): Qwen3-MoE
(top-2 of 8 unnormalized, layer 1 dense) and Mixtral (renormalized, windows of 12), chunked and
batched as test_families_core serves every family, on both CPU paths; the routing seen on the way
is uneven and leaves experts without a token. The Triton kernel's own checks: test_triton_moe.py."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.model.config import ModelConfig
from services.scheduler.model.moe import SparseMoE, experts_reference, route
from tests.services.scheduler.model.test_families_core import check_against_transformers, serve


def expert_loads(monkeypatch) -> list[torch.Tensor]:
    """Every sparse layer call's tokens per expert [E], recorded while the test runs."""
    loads: list[torch.Tensor] = []
    forward = SparseMoE.forward

    def recording(self, x, fused=False):
        _, ids = route(self.gate(x), self.top_k, self.renormalize)
        loads.append(torch.bincount(ids.flatten(), minlength=self.gate.out_features))
        return forward(self, x, fused)

    monkeypatch.setattr(SparseMoE, "forward", recording)
    return loads


@pytest.mark.parametrize("graph_twins", [False, True], ids=["sdpa-groups", "graph-twins"])
@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_moe_core_matches_transformers(saved_family, monkeypatch, family: str, graph_twins: bool) -> None:
    model, path = saved_family(family)
    loads = expert_loads(monkeypatch)
    results, prompts = serve(path, graph_twins)
    for rid, result in results.items():
        assert len(result.tokens) == 10
        check_against_transformers(model, result, prompts[rid])
    assert any(bool((load == 0).any()) for load in loads)  # an expert with no token
    assert any(int(load.max()) >= int(load[load > 0].min()) + 3 for load in loads)  # uneven loads


def test_qwen3_moe_config_places_dense_layers() -> None:
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "decoder_sparse_step": 2, "mlp_only_layers": [3]}  # fmt: skip
    config = ModelConfig.from_dict(raw)
    assert config.dense_layers == (0, 2, 3, 4) and not config.norm_topk_prob
    assert ModelConfig.from_dict({**raw, "norm_topk_prob": True, "decoder_sparse_step": 1}).dense_layers == (3,)


def test_routing_normalizations() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, dim=-1)[0]
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1]] and torch.allclose(weights[0], probs[:2])
    weights, _ = route(logits, 2, renormalize=True)
    assert torch.allclose(weights[0], probs[:2] / probs[:2].sum())


def test_experts_reference_is_the_sum_of_each_tokens_experts() -> None:
    gen = torch.Generator().manual_seed(0)
    x, gate_up, down = torch.randn(5, 8, generator=gen), torch.randn(4, 12, 8, generator=gen), torch.randn(4, 8, 6, generator=gen)
    ids = torch.tensor([[0, 2], [2, 0], [2, 1], [0, 2], [2, 0]])  # expert 3 gets none, 2 gets every token
    weights = torch.rand(5, 2, generator=gen)
    out = experts_reference(x, gate_up, down, weights, ids)
    for t in range(5):
        expected = sum(weights[t, j] * down[e] @ (torch.nn.functional.silu(gate_up[e, :6] @ x[t]) * (gate_up[e, 6:] @ x[t]))
                       for j, e in enumerate(ids[t].tolist()))  # fmt: skip
        torch.testing.assert_close(out[t], expected, atol=1e-5, rtol=1e-5)


def test_dspark_on_qwen3_moe_is_lossless(saved_family, tmp_path) -> None:
    # A drafter reading the MoE target's layer 1 (verify steps of q = 5 route every drafted token):
    # the speculative greedy output and logprobs still equal transformers'.
    from services.scheduler.model.loader import load_model_runner
    from tests.services.scheduler.model.test_families_core import check_speculative_against_transformers, random_drafter

    model, path = saved_family("qwen3-moe")
    runner = load_model_runner(path, num_kv_blocks=48, kv_block_size=16)
    check_speculative_against_transformers(model, runner, random_drafter(runner, tmp_path))


def test_deterministic_mode_refuses_a_moe_model(saved_family) -> None:
    # Its experts' products are not batch-invariant: the mode says so rather than promise it.
    from services.scheduler.model.loader import load_model_runner

    _, path = saved_family("qwen3-moe")
    with pytest.raises(ValueError, match="--deterministic covers dense"):
        load_model_runner(path, num_kv_blocks=8, kv_block_size=16, batch_invariant=True)
