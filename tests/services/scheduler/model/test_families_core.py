"""Every supported architecture through the scheduler core, against transformers (issue 42, done-when 1).

Each family's tiny random model (conftest `FAMILY_CONFIGS`, fp32, saved by transformers) serves
three greedy requests together in 16-token steps (prompts of 24, 37 and 45 tokens: chunked, batched
beside decodes), every logprob kind asked for. Then transformers' plain forward over each final
sequence must give the same greedy tokens and, within 1e-4, every logprob returned: the prompt's
(from position 0), the chosen tokens', the top 5 and the requested ids'. Sliding-window families
(windows of 12) run past their windows, RoPE-scaled ones (original context 32) past the original
context. Two paths: the CPU's ragged SDPA groups, and the padded graph runners' twins (decode and
ragged steps replayed eagerly, on the decode and varlen kernels' torch twins), as CUDA runs them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from contracts.scheduler import LogprobParams
from services.scheduler.build import core_for
from services.scheduler.model.loader import load_model_runner
from tests.services.scheduler.test_scheduler_core import request, run

TOL = 1e-4
LOGPROBS = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=5, token_ids_logprob=(7, 3, 300))
PROMPT_LENS = (37, 24, 45)  # + 10 new tokens: every sequence past 32
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "qwen2-window", "qwen3-yarn", "llama-dynamic", "gemma2", "gemma3", "phi3"]


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_rows(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """log p(. | tokens[:r + 1]) for every row r, from one transformers forward: f32 [n, V]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def serve(path, graph_twins: bool, max_model_len: int | None = None, lens=PROMPT_LENS, max_new_tokens: int = 10):
    """The requests' results and prompts, served by a core on the model at `path`."""
    runner = load_model_runner(path, num_kv_blocks=48, kv_block_size=16, max_model_len=max_model_len)
    if graph_twins:  # the CUDA routing, eagerly: padded static batches on the kernels' torch twins
        runner.prepare_decode_graphs(ladder=(1, 2, 4), capture=False)
        runner.prepare_ragged_graphs((1, 2, 4), (16, 32), capture=False)
    core = core_for(runner, max_running_requests=8, chunked_prefill_size=16, seed=0, max_model_len=max_model_len)
    prompts = {f"r{i}": prompt(n, seed=i) for i, n in enumerate(lens)}
    requests = [request(rid, p, max_new_tokens=max_new_tokens, logprobs=LOGPROBS, ignore_eos=True) for rid, p in prompts.items()]
    return run(core, requests), prompts


def check_rows(rows: torch.Tensor, targets: list[int], token, top_values, top_ids, ids) -> None:
    np.testing.assert_allclose(token, rows[torch.arange(len(targets)), targets].numpy(), atol=TOL)
    np.testing.assert_allclose(top_values, rows.topk(LOGPROBS.top_logprobs_num, dim=-1).values.numpy(), atol=TOL)
    np.testing.assert_allclose(top_values, rows.gather(1, torch.from_numpy(top_ids).long()).numpy(), atol=TOL)
    np.testing.assert_allclose(ids, rows[:, list(LOGPROBS.token_ids_logprob)].numpy(), atol=TOL)


def check_against_transformers(model: torch.nn.Module, result, prompt_ids: list[int]) -> None:
    rows = reference_rows(model, prompt_ids + result.tokens)  # [n, V]
    n = len(prompt_ids)
    assert result.tokens == rows[n - 1 : -1].argmax(dim=-1).tolist()  # greedy
    assert np.isnan(result.cat("input_token")[0]) and len(result.cat("input_token")) == n
    prompt_rows = (result.cat(name)[1:] for name in ("input_token", "input_top_values", "input_top_ids", "input_ids"))
    check_rows(rows[: n - 1], prompt_ids[1:], *prompt_rows)
    output_rows = (result.cat(name) for name in ("output_token", "output_top_values", "output_top_ids", "output_ids"))
    check_rows(rows[n - 1 : -1], result.tokens, *output_rows)


@pytest.mark.parametrize("graph_twins", [False, True], ids=["sdpa-groups", "graph-twins"])
@pytest.mark.parametrize("family", FAMILIES)
def test_core_matches_transformers(saved_family, family: str, graph_twins: bool) -> None:
    model, path = saved_family(family)
    results, prompts = serve(path, graph_twins)
    assert sorted(results) == sorted(prompts)
    for rid, result in results.items():
        assert len(result.tokens) == 10
        check_against_transformers(model, result, prompts[rid])


def test_phi3_within_its_original_context_takes_the_short_factors(saved_family) -> None:
    # Served at --max-model-len 32 (the original context), every sequence is one transformers reads
    # with the short factors; the default context (512) takes the long ones (the case above).
    model, path = saved_family("phi3")
    results, prompts = serve(path, graph_twins=False, max_model_len=32, lens=(20, 13), max_new_tokens=8)
    for rid, result in results.items():
        check_against_transformers(model, result, prompts[rid])


def random_drafter(runner, tmp_path):
    """A one-layer DSpark drafter of random weights reading the target's layer 1, saved and loaded as served."""
    from services.scheduler.spec.dspark_config import draft_config_for_target
    from services.scheduler.spec.dspark_loader import empty_drafter, fill_random_weights, load_dspark_proposer, save_drafter

    config = draft_config_for_target(runner.config, num_draft_layers=1, mask_token_id=5, block_size=4, markov_rank=8,
                                     target_layer_ids=(1,))  # fmt: skip
    drafter = empty_drafter(config, runner.model.model.embed_tokens, runner.lm_head_weight)
    fill_random_weights(drafter, seed=3)
    return load_dspark_proposer(save_drafter(drafter, tmp_path / "draft"), runner)


def check_speculative_against_transformers(model, runner, proposer) -> None:
    """Greedy DSpark over PROMPT_LENS (verify steps of q = 5): every request verified, and its ids
    and logprobs equal transformers' (lossless)."""
    runner.prepare_decode_graphs(ladder=(1, 2, 4), query_lens=(1, 5), capture=False, capture_layers=(1,))
    core = core_for(runner, max_running_requests=8, chunked_prefill_size=16, seed=0, proposer=proposer)
    prompts = {f"r{i}": prompt(n, seed=i) for i, n in enumerate(PROMPT_LENS)}
    requests = [request(rid, p, max_new_tokens=10, logprobs=LOGPROBS, ignore_eos=True) for rid, p in prompts.items()]
    results = run(core, requests)
    assert all(result.spec_verify_ct for result in results.values())
    for rid, result in results.items():
        check_against_transformers(model, result, prompts[rid])


def test_dspark_on_gemma2_uses_the_scaled_embedding_and_the_soft_capped_head(saved_family, tmp_path) -> None:
    # The drafter shares the target's embedding module and head (gemma.py says why q is soft-capped
    # too); speculative greedy output and logprobs still equal transformers' (lossless).
    model, path = saved_family("gemma2")
    runner = load_model_runner(path, num_kv_blocks=48, kv_block_size=16)
    proposer = random_drafter(runner, tmp_path)
    loaded = proposer.drafter
    assert loaded.target.logit_softcap == 6.0
    ids = torch.tensor([[9, 17]])
    torch.testing.assert_close(loaded.block_embeddings(ids[:, 0])[0, 0], model.model.embed_tokens(ids)[0, 0])
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded.base_logits(hidden), model.lm_head(hidden).div(6.0).tanh().mul(6.0))
    check_speculative_against_transformers(model, runner, proposer)
