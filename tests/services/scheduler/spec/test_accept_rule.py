"""spec.accept: greedy prefix semantics on hand-made blocks, and losslessness of speculative sampling.

The statistical tests draw everything for real (drafts from q, uniforms, Exp(1) noise) from fixed
seeds and compare the emitted tokens' joint distribution with the target's by a chi-square test.
Threshold: p-value > 1e-4. Under a correct rule a seeded run lands below that with probability 1e-4;
the negative checks show that plausible wrong rules, on the same draws, give p-values < 1e-12.
"""

from __future__ import annotations

import torch

from services.scheduler.spec.accept import VerifyBlock, accept
from tests.services.scheduler.spec.chi_square import chi_square_p_value

P_VALUE_THRESHOLD = 1e-4
VOCAB = 5
NUM_DRAFTS = 2  # K; the test looks at K + 1 emitted tokens, so the bonus token is judged too
NUM_TRIALS = 100_000
ANCHOR = 3


def greedy_block(drafts, target_argmax, num_draft) -> VerifyBlock:
    return VerifyBlock(
        target_argmax=torch.tensor(target_argmax),
        drafts=torch.tensor(drafts),
        num_draft=torch.tensor(num_draft),
        is_greedy=torch.ones(len(drafts), dtype=torch.bool),
    )


def test_greedy_accepts_the_longest_matching_prefix_then_the_first_unmatched_argmax():
    block = greedy_block(
        drafts=[[5, 7, 9], [5, 7, 9], [5, 7, 9], [5, 8, 9], [4, 7, 9], [5, 99, 99], [99, 99, 99]],
        target_argmax=[[5, 7, 1, 4], [5, 7, 9, 4], [5, 7, 9, 4], [5, 7, 9, 4], [5, 7, 9, 4], [5, 6, 0, 0], [2, 0, 0, 0]],
        num_draft=[3, 3, 2, 3, 3, 1, 0],
    )
    accepted, next_token = accept(block)
    assert accepted.tolist() == [2, 3, 2, 1, 0, 1, 0]
    # all matched -> the bonus row; past num_draft nothing is judged (row 2 stops at its 2 drafts).
    assert next_token.tolist() == [1, 4, 9, 7, 5, 6, 2]


def test_greedy_rows_ignore_sampling_inputs_in_a_mixed_batch():
    p = torch.full((2, 3, VOCAB), 1.0 / VOCAB)
    block = VerifyBlock(
        target_argmax=torch.tensor([[1, 2, 3], [1, 2, 3]]),
        drafts=torch.tensor([[1, 2], [1, 2]]),
        num_draft=torch.tensor([2, 2]),
        is_greedy=torch.tensor([True, False]),
        target_weights=p,
        draft_probs=torch.full((2, 2, VOCAB), 1.0 / VOCAB),
        uniforms=torch.tensor([[0.99, 0.99], [0.99, 0.99]]),  # q == p: the sampled row accepts anyway
        noise=torch.ones(2, VOCAB),
    )
    accepted, next_token = accept(block)
    assert accepted.tolist() == [2, 2] and next_token[0].item() == 3


def test_point_mass_drafts_accept_with_probability_p_and_resample_without_the_draft():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])[None].expand(2, -1, -1)  # [2, 2, V]
    block = VerifyBlock(
        target_argmax=torch.zeros(2, 2, dtype=torch.int64),
        drafts=torch.tensor([[0], [0]]),
        num_draft=torch.tensor([1, 1]),
        is_greedy=torch.tensor([False, False]),
        target_weights=p.contiguous(),
        draft_probs=None,
        uniforms=torch.tensor([[0.4], [0.6]]),  # accept iff u * 1 < p(d) = 0.5
        noise=torch.ones(2, VOCAB),
    )
    accepted, next_token = accept(block)
    assert accepted.tolist() == [1, 0]
    assert next_token[1].item() == 1  # the residual is p with the draft removed: only token 1 is left


# -- losslessness ------------------------------------------------------------------------------


def chain(generator: torch.Generator, favour_high: bool, zero_column: int | None) -> torch.Tensor:
    """K + 1 conditional tables [K + 1, V, V]: row [j, t] = distribution of slot j's token after token t."""
    slope = torch.arange(VOCAB, dtype=torch.float64) * (0.8 if favour_high else -0.6)
    logits = torch.randn(NUM_DRAFTS + 1, VOCAB, VOCAB, generator=generator, dtype=torch.float64) * 0.5 + slope
    tables = logits.softmax(dim=-1)
    if zero_column is not None:  # a token this side never emits (q: never drafted; p: must always be rejected)
        tables[..., zero_column] = 0.0
        tables /= tables.sum(dim=-1, keepdim=True)
    return tables


def sample_rows(tables: torch.Tensor, previous: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row from tables[previous] [N, V], by inverse CDF (multinomial is slow on many rows)."""
    cdf = tables[previous].cumsum(dim=-1)  # [N, V]
    u = torch.rand(previous.shape[0], 1, generator=generator, dtype=cdf.dtype)
    return (cdf[:, :-1] <= u).sum(dim=-1)  # zero-probability tokens are never drawn


def draw_block(p_chain, q_chain, generator, point_mass: bool = False):
    """Drafts d_1..d_K from q (or its argmax), each trial's verify rows p_j(. | d_j) and q_j(. | d_j)."""
    previous = torch.full((NUM_TRIALS,), ANCHOR)
    drafts, q_rows = [], []
    for slot in range(NUM_DRAFTS):
        q = q_chain[slot][previous]  # [N, V]
        draft = q.argmax(dim=-1) if point_mass else sample_rows(q_chain[slot], previous, generator)
        drafts.append(draft)
        q_rows.append(q)
        previous = draft
    drafts = torch.stack(drafts, dim=1)  # [N, K]
    prefix = torch.cat((torch.full((NUM_TRIALS, 1), ANCHOR), drafts), dim=1)  # [N, K + 1]: d_0 = anchor
    p_rows = torch.stack([p_chain[j][prefix[:, j]] for j in range(NUM_DRAFTS + 1)], dim=1)  # [N, K + 1, V]
    return drafts, p_rows.float(), torch.stack(q_rows, dim=1).float()


def emitted_tokens(p_chain, drafts, accepted, next_token, generator) -> torch.Tensor:
    """The first K + 1 tokens of each sequence; where a step emitted fewer, plain decoding continues."""
    tokens, previous = [], torch.full((NUM_TRIALS,), ANCHOR)
    for slot in range(NUM_DRAFTS + 1):
        draft = drafts[:, slot] if slot < NUM_DRAFTS else next_token
        continued = sample_rows(p_chain[slot], previous, generator)
        token = torch.where(slot < accepted, draft, torch.where(slot == accepted, next_token, continued))
        tokens.append(token)
        previous = token
    return torch.stack(tokens, dim=1)  # [N, K + 1]


def chain_joint(p_chain: torch.Tensor) -> torch.Tensor:
    """Probability of every (x_1, ..., x_{K+1}) under the target chain from the anchor, flattened."""
    joint = p_chain[0][ANCHOR]  # [V]
    for slot in range(1, NUM_DRAFTS + 1):
        # [V^(s-1) earlier tokens, V previous token, 1] x [1, V previous, V next]; the last token varies fastest
        joint = (joint.reshape(-1, VOCAB)[:, :, None] * p_chain[slot][None]).reshape(-1)
    return joint


def cells(tokens: torch.Tensor) -> torch.Tensor:
    """[N, L] tokens -> [N] cell ids, the first token most significant (the order of chain_joint)."""
    cell = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for slot in range(tokens.shape[1]):
        cell = cell * VOCAB + tokens[:, slot]
    return cell


def run_rule(seed: int, *, point_mass_drafts: bool = False, hide_q: bool = False, wrong_q=None, uniforms_zero: bool = False) -> float:
    """wrong_q: a function of the true q rows [N, K, V] that models a proposer bug (the test must catch it)."""
    generator = torch.Generator().manual_seed(seed)
    p_chain = chain(generator, favour_high=False, zero_column=VOCAB - 1)
    q_chain = chain(generator, favour_high=True, zero_column=0)  # q strongly differs from p
    drafts, p_rows, q_rows = draw_block(p_chain, q_chain, generator, point_mass=point_mass_drafts)
    num_draft = torch.randint(0, NUM_DRAFTS + 1, (NUM_TRIALS,), generator=generator)  # ragged blocks too
    uniforms = torch.rand(NUM_TRIALS, NUM_DRAFTS, generator=generator)
    block = VerifyBlock(
        target_argmax=p_rows.argmax(dim=-1),
        drafts=drafts,
        num_draft=num_draft,
        is_greedy=torch.zeros(NUM_TRIALS, dtype=torch.bool),
        target_weights=p_rows,
        draft_probs=None if (point_mass_drafts or hide_q) else (wrong_q or (lambda q: q))(q_rows),
        uniforms=torch.zeros_like(uniforms) if uniforms_zero else uniforms,
        noise=torch.empty(NUM_TRIALS, VOCAB).exponential_(generator=generator),
    )
    accepted, next_token = accept(block)
    tokens = emitted_tokens(p_chain, drafts, accepted, next_token, generator)
    return chi_square_p_value(cells(tokens), chain_joint(p_chain))


def test_speculative_sampling_gives_the_target_distribution():
    for seed in (0, 1):
        p_value = run_rule(seed)
        assert p_value > P_VALUE_THRESHOLD, f"seed {seed}: p = {p_value:.2e}"


def test_point_mass_drafts_without_q_give_the_target_distribution():
    p_value = run_rule(2, point_mass_drafts=True)
    assert p_value > P_VALUE_THRESHOLD, f"p = {p_value:.2e}"


def test_taking_q_as_one_is_lossless_even_for_sampled_drafts():
    # Accept with p(d), else sample p without d: P(x) = q(x) p(x) + sum_{d != x} q(d) p(x) = p(x) for any q;
    # it only accepts less. (So the rule accept.py uses for q = None is safe whatever drafted.)
    assert run_rule(3, hide_q=True) > P_VALUE_THRESHOLD


def test_the_chi_square_test_rejects_wrong_rules():
    # q of the wrong slot (a proposer/verify misalignment by one position).
    assert run_rule(0, wrong_q=lambda q: q.roll(1, dims=1)) < 1e-12
    # q at another temperature than the drafts were sampled at (q^2 renormalised: T halved).
    assert run_rule(0, wrong_q=lambda q: q**2 / (q**2).sum(-1, keepdim=True)) < 1e-12
    # Accepting every draft the target can emit (u = 0): the output follows q, not p.
    assert run_rule(0, uniforms_zero=True) < 1e-12
