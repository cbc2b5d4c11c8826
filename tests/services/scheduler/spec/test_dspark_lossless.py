"""Done-when 3 end to end on the drafter side: DSpark's own drafts and q (Markov-conditioned, slot by
slot), verified by spec.accept against a target chain p that differs strongly from q, emit tokens
distributed as the target's. Chi-square on each emitted position's marginal, threshold p > 1e-4
(fixed seeds); a proposer that reported q of the wrong slot is caught on the same draws."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.spec.accept import VerifyBlock, accept
from services.scheduler.spec.base import ContextRows, DraftRequest
from services.scheduler.spec.dspark import DSparkProposer
from services.scheduler.policy.verify_budget import VerifyBudget
from tests.services.scheduler.spec.chi_square import chi_square_p_value

NUM_TRIALS = 10_000
ANCHOR_TOKEN, ANCHOR_POSITION = 11, 6
P_VALUE_THRESHOLD = 1e-4


def target_chain(vocab: int, gamma: int, generator: torch.Generator) -> torch.Tensor:
    """[gamma + 1, V, V]: p_j(next | previous); low ids favoured, token 0 never emitted."""
    logits = torch.randn(gamma + 1, vocab, vocab, generator=generator, dtype=torch.float64) - 0.08 * torch.arange(vocab)
    tables = logits.softmax(dim=-1)
    tables[..., 0] = 0.0
    return tables / tables.sum(dim=-1, keepdim=True)


def propose_many(drafter) -> tuple[torch.Tensor, torch.Tensor]:
    proposer = DSparkProposer(drafter, num_blocks=4, block_size=4)
    width = drafter.config.num_context_layers * drafter.config.hidden_size
    hidden = torch.randn(ANCHOR_POSITION, width, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(ANCHOR_POSITION)
    proposer.inject(ContextRows(hidden=hidden, positions=positions, slots=positions + 4))  # blocks 1, 2
    table = torch.tensor([[1, 2]], dtype=torch.int32).expand(NUM_TRIALS, -1)
    proposal = proposer.propose(
        DraftRequest(
            rids=("r",) * NUM_TRIALS,
            anchor_tokens=torch.full((NUM_TRIALS,), ANCHOR_TOKEN),
            anchor_positions=torch.full((NUM_TRIALS,), ANCHOR_POSITION),
            block_tables=table,
            max_anchor_position=ANCHOR_POSITION,
            temperatures=(1.0,) * NUM_TRIALS,
            seeds=tuple(range(NUM_TRIALS)),
        )
    )
    return proposal.tokens, proposal.probs, proposal.confidence  # [N, gamma], [N, gamma, V], [N, gamma]


def sample_from(rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    cdf = rows.cumsum(dim=-1)  # [N, V]
    return (cdf[:, :-1] <= torch.rand(rows.shape[0], 1, generator=generator, dtype=cdf.dtype)).sum(dim=-1)


def emitted_marginal_p_values(drafts, q, p_chain, generator, num_draft=None) -> list[float]:
    gamma = drafts.shape[1]
    num_draft = torch.full((NUM_TRIALS,), gamma) if num_draft is None else num_draft
    prefix = torch.cat((torch.full((NUM_TRIALS, 1), ANCHOR_TOKEN), drafts), dim=1)  # [N, gamma + 1]
    p_rows = torch.stack([p_chain[j][prefix[:, j]] for j in range(gamma + 1)], dim=1).float()  # [N, gamma + 1, V]
    block = VerifyBlock(
        target_argmax=p_rows.argmax(dim=-1), drafts=drafts, num_draft=num_draft,
        is_greedy=torch.zeros(NUM_TRIALS, dtype=torch.bool), draft_probs=q,
        target_weights=p_rows / p_rows.amax(dim=-1, keepdim=True),  # unnormalised, as `sampling_weights` gives them
        uniforms=torch.rand(NUM_TRIALS, gamma, generator=generator),
        noise=torch.empty(NUM_TRIALS, q.shape[2]).exponential_(generator=generator),
    )  # fmt: skip
    accepted, next_token = accept(block)
    previous, marginal, p_values = torch.full((NUM_TRIALS,), ANCHOR_TOKEN), p_chain[0][ANCHOR_TOKEN], []
    for slot in range(gamma + 1):
        draft = drafts[:, slot] if slot < gamma else next_token
        continued = sample_from(p_chain[slot][previous], generator)  # plain decoding after a short step
        token = torch.where(slot < accepted, draft, torch.where(slot == accepted, next_token, continued))
        p_values.append(chi_square_p_value(token, marginal))
        previous = token
        marginal = marginal @ p_chain[slot + 1] if slot < gamma else None
    return p_values


@pytest.fixture(scope="module")
def proposals(drafter):
    return propose_many(drafter)


def test_dspark_drafts_verified_by_accept_follow_the_target(proposals):
    drafts, q, _ = proposals
    p_chain = target_chain(q.shape[2], drafts.shape[1], torch.Generator().manual_seed(1))
    assert (q.double() - p_chain[0][ANCHOR_TOKEN]).abs().sum(dim=-1).mean() > 0.5  # q and p differ strongly
    p_values = emitted_marginal_p_values(drafts, q, p_chain, torch.Generator().manual_seed(2))
    assert min(p_values) > P_VALUE_THRESHOLD, p_values
    wrong = emitted_marginal_p_values(drafts, q.roll(1, dims=1), p_chain, torch.Generator().manual_seed(2))
    assert min(wrong) < 1e-9, wrong


def test_verify_lengths_cut_by_this_blocks_confidence_stay_lossless(proposals):
    """`compact`: each request verifies the prefix whose survival reaches the previous step's lambda."""
    drafts, q, confidence = proposals
    budget = VerifyBudget(lambda tokens: 1.0)
    budget.threshold = float(confidence.cumprod(dim=1)[:, 1].median())  # cuts the blocks unevenly
    num_draft = torch.tensor([budget.num_to_verify(row, drafts.shape[1]) for row in confidence.tolist()])
    assert len(set(num_draft.tolist())) > 2
    p_chain = target_chain(q.shape[2], drafts.shape[1], torch.Generator().manual_seed(1))
    p_values = emitted_marginal_p_values(drafts, q, p_chain, torch.Generator().manual_seed(3), num_draft)
    assert min(p_values) > P_VALUE_THRESHOLD, p_values
