"""What step 4 (verify) hands on: each producer's accepted drafts and next token, and the rows its
output logprobs read; and, under tensor parallelism, the pieces `ModelWorker._verify_on_shards`
builds it from (tokens drawn from vocabulary shards, producers whose rows were gathered whole)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from services.scheduler.spec.accept import VerifyBlock, accept


@dataclass(frozen=True)
class Verified:
    """The producers' outcome of one step's verify (`ModelWorker._verify`)."""

    logits: torch.Tensor | None  # f32 [P, K + 1, V], what output logprobs read: raw, or after logits_processing
    # when processed; None: sampled from vocabulary shards, whose output logprobs come from `hidden`
    num_accepted: torch.Tensor | None  # int64 [P]; None: no drafts were verified (plain greedy decoding), none accepted
    next_token: torch.Tensor  # int64 [P]
    tokens: torch.Tensor  # int64 [P, K + 1]: accepted drafts, then next_token (then padding); from
    # `_greedy_rows` [R, 1] with R >= P (rows past P: a decode graph's padded rows, never read)
    hidden: torch.Tensor | None = None  # [P (K + 1), H]: the verify rows, where their logprobs come from the shards


def block_tokens(drafts: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """int64 [P, K + 1]: each block's accepted drafts, then its next token (then padding)."""
    slots = torch.arange(drafts.shape[1] + 1, device=drafts.device)  # [K + 1]
    padded = torch.cat([drafts, next_token[:, None]], dim=1)  # [P, K + 1]
    return torch.where(slots[None, :] < num_accepted[:, None], padded, next_token[:, None])


def rows_of(arrays: dict[str, torch.Tensor], producers: list[int], others: list[int]) -> dict[str, torch.Tensor]:
    """The accept rule's arrays of some producers (all of them where `others` is empty)."""
    index = torch.tensor(producers, device=arrays["positions"].device) if others else None
    return {name: arrays[name] if index is None else arrays[name][index]
            for name in ("drafts", "num_draft", "is_greedy") if name in arrays}  # fmt: skip


def accepted_argmax(drawn: torch.Tensor, arrays: dict[str, torch.Tensor]) -> Verified:
    """Tokens drawn from the shards [S, K + 1] (each row's argmax; a sampled row without drafts, its
    draw) -> the greedy accept rule's tokens (no drafts to accept: the first row's token)."""
    if "drafts" not in arrays:
        return Verified(None, None, drawn[:, 0], drawn[:, :1])
    block = VerifyBlock(drawn, arrays["drafts"], arrays["num_draft"], torch.ones_like(arrays["num_draft"], dtype=torch.bool))
    num_accepted, next_token = accept(block)
    return Verified(None, num_accepted, next_token, block_tokens(block.drafts, num_accepted, next_token))


def merged(parts: list[tuple[list[int], Verified]], num_producers: int, hidden: torch.Tensor) -> Verified:
    """One `Verified` of every producer from parts over some of them (positions, result); output
    logprobs from the shards, over `hidden` [P (K + 1), H]."""
    if len(parts) == 1:
        return dataclasses.replace(parts[0][1], logits=None, hidden=hidden)
    index = [torch.tensor(positions, device=hidden.device) for positions, _ in parts]

    def join(name: str) -> torch.Tensor | None:
        first = getattr(parts[0][1], name)
        if first is None:
            return None
        out = first.new_empty(num_producers, *first.shape[1:])
        for rows, (_, part) in zip(index, parts, strict=True):
            out[rows] = getattr(part, name)
        return out

    return Verified(None, join("num_accepted"), join("next_token"), join("tokens"), hidden)
