"""The accept rule: which drafted tokens survive verification, and the token that follows them.

Sequence b verified `num_draft[b]` drafts d_1..d_k in one target forward over
[anchor, d_1, ..., d_k]; verify row j is the target's distribution p_j of the token after
position anchor + j, so row j judges d_{j+1} and row k gives the bonus.

- Greedy: accept the longest prefix with d_{j+1} == argmax(p_j); the next token is the argmax of
  the first row that was not matched (the bonus row when all were).
- Sampling (lossless speculative sampling): accept d_{j+1} when u_j * q_j(d_{j+1}) < p_j(d_{j+1})
  (so q <= p always accepts); at the first rejection sample normalize(max(p_j - q_j, 0)) instead;
  all accepted -> the bonus is sampled from p_k. Point-mass drafts (q = None) take q(d) = 1:
  accept with probability p(d), the residual is p with d removed — exact for an argmax draft.

The last token is drawn Gumbel-max style, argmax(r / E) with E ~ Exp(1), from noise that does not
depend on where the block stopped, so with no drafts this is exactly the plain sampler's draw. p
comes as the sampler's unnormalised weights w (p = w / sum(w)): the accept test and the residual
normalise, the bonus and no-draft draws race on w itself, with no sum in them (`sampler.py`).
Everything stays on the device: the accepted counts reach the host with the step's one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifyBlock:
    """B sequences' verify rows, padded to K drafts (rows past num_draft are ignored)."""

    target_argmax: torch.Tensor  # int64 [B, K + 1], argmax of each row's raw logits
    drafts: torch.Tensor  # int64 [B, K]
    num_draft: torch.Tensor  # int64 [B], 0..K
    is_greedy: torch.Tensor  # bool [B]
    target_weights: torch.Tensor | None = None  # f32 [B, K + 1, V], the sampler's w (`sampling_weights`); None when all greedy
    draft_probs: torch.Tensor | None = None  # f32 [B, K, V], q; None: point-mass drafts
    uniforms: torch.Tensor | None = None  # f32 [B, K], U(0, 1) per draft
    noise: torch.Tensor | None = None  # f32 [B, V], Exp(1) for the last token's draw


def accept(block: VerifyBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (num_accepted int64 [B], next_token int64 [B]); the sequence gains d_1..d_a, next_token."""
    if block.drafts.shape[1] == 0 and block.target_weights is None:  # plain greedy decoding
        return torch.zeros_like(block.num_draft), block.target_argmax[:, 0]
    valid = _draft_positions(block)  # [B, K]
    matched = block.drafts == block.target_argmax[:, :-1]  # [B, K]
    greedy_accepted = _leading_true(matched & valid)  # [B]
    greedy_next = block.target_argmax.gather(1, greedy_accepted[:, None])[:, 0]  # [B]
    if block.target_weights is None:
        return greedy_accepted, greedy_next
    sampled_accepted, sampled_next = _accept_sampled(block, valid)
    return (
        torch.where(block.is_greedy, greedy_accepted, sampled_accepted),
        torch.where(block.is_greedy, greedy_next, sampled_next),
    )


def _accept_sampled(block: VerifyBlock, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w, drafts = block.target_weights, block.drafts
    mass = w.sum(dim=2)  # [B, K + 1]
    p_draft = w[:, :-1].gather(2, drafts[..., None])[..., 0] / mass[:, :-1]  # [B, K]
    q_draft = torch.ones_like(p_draft) if block.draft_probs is None else block.draft_probs.gather(2, drafts[..., None])[..., 0]
    accepted = _leading_true((block.uniforms * q_draft < p_draft) & valid)  # [B]
    row = w.gather(1, accepted[:, None, None].expand(-1, 1, w.shape[2]))[:, 0]  # [B, V], w_a
    rejected = accepted < block.num_draft  # [B]: stopped at a rejection, not at the bonus row
    p_row = row / mass.gather(1, accepted[:, None])  # [B, V], p_a
    residual = (p_row - _draft_row(block, accepted)).clamp_min(0.0)  # [B, V], max(p_a - q_a, 0)
    # p == q exactly leaves no residual mass; that rejection had probability 0, so keep p.
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, row)
    final = torch.where(rejected[:, None], residual, row)  # unnormalised: argmax(r / E) ignores scale
    return accepted, (final / block.noise).argmax(dim=1)


def _draft_row(block: VerifyBlock, accepted: torch.Tensor) -> torch.Tensor:
    """q_a of each sequence's first unaccepted draft, [B, V] (zeros where a == K)."""
    batch, num_slots = block.drafts.shape
    vocab = block.target_weights.shape[2]
    if num_slots == 0:
        return torch.zeros(batch, vocab, device=block.drafts.device)
    index = accepted.clamp_max(num_slots - 1)  # [B]
    if block.draft_probs is None:
        draft = block.drafts.gather(1, index[:, None])  # [B, 1]
        return torch.zeros(batch, vocab, device=draft.device).scatter_(1, draft, 1.0)
    return block.draft_probs.gather(1, index[:, None, None].expand(-1, 1, vocab))[:, 0]


def _draft_positions(block: VerifyBlock) -> torch.Tensor:
    slots = torch.arange(block.drafts.shape[1], device=block.drafts.device)  # [K]
    return slots[None, :] < block.num_draft[:, None]  # [B, K]


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """bool [B, K] -> int64 [B]: how many leading entries of each row are True."""
    return mask.long().cumprod(dim=1).sum(dim=1)
