"""The seam between the model worker and a draft proposer (DSpark, or a test's oracle).

Per step, after the target forward and the accept rule, the worker calls a proposer twice:

1. `inject(ContextRows)`: every row of the step (prefill chunks, verify blocks, rejected draft
   rows too) hands its captured target-layer hidden states to the drafter, which writes them into
   its own paged KV cache at the same slots as the target's. Rows past a sequence's committed
   length are stale, exactly like rejected slots of the target KV: attention never reads past
   the anchor, and the next step overwrites them.
2. `propose(DraftRequest)`: every sequence that produced a token this step drafts its next block
   from that token (the anchor). Anchors and their positions stay on the device (they depend on
   how many drafts were accepted), so proposing costs no host sync; the proposal's tokens travel
   back to the host in the step's one device->host copy.

The draft distribution `probs` (q) stays on the device until the next step verifies the block:
rejection sampling needs q(d) and max(p - q, 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ContextRows:
    """All T rows of one target forward."""

    hidden: torch.Tensor  # [T, len(capture_layers) * H], the captured target layers' outputs
    positions: torch.Tensor  # int64 [T], each row's token position in its sequence
    slots: torch.Tensor  # int64 [T], each row's KV slot (the same slot in the draft cache)


@dataclass(frozen=True)
class DraftRequest:
    """B sequences that draft their next block this step."""

    rids: tuple[str, ...]  # [B], for proposers that look requests up (tests' oracles)
    anchor_tokens: torch.Tensor  # int64 [B], the last committed token (just sampled)
    anchor_positions: torch.Tensor  # int64 [B], its position: committed length - 1
    block_tables: torch.Tensor  # int32 [B, M], the sequences' KV blocks (shared with the target)
    max_anchor_position: int  # host-side upper bound on anchor_positions (sizes key reads)
    temperatures: tuple[float, ...]  # [B], <= 0: greedy drafts (argmax of q)
    seeds: tuple[int, ...]  # [B], generator seed of each row's draft sampling noise


@dataclass(frozen=True)
class DraftProposal:
    tokens: torch.Tensor  # int64 [B, gamma]
    probs: torch.Tensor | None  # f32 [B, gamma, V], q of every position; None when all rows are greedy
    confidence: torch.Tensor | None = None  # f32 [B, gamma], chance each token survives (confidence head)


class Proposer(Protocol):
    num_draft_tokens: int  # gamma: tokens per proposed block
    capture_layers: tuple[int, ...]  # target layers whose outputs `inject` needs; () for none
    has_confidence: bool  # its blocks can carry confidences (`compact` needs them)

    def inject(self, context: ContextRows) -> None: ...

    def propose(self, request: DraftRequest) -> DraftProposal: ...
