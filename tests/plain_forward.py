"""The reference every logprob test compares with: one plain forward pass over a whole sequence.

It writes KV slots 0..n-1 of the runner's cache, so use a runner of its own (never one a
scheduler core is using at the same time).
"""

from __future__ import annotations

import torch

from services.scheduler.model import ForwardBatch, ModelRunner


@torch.inference_mode()
def reference_logprobs(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Row r is log p(. | tokens[:r+1]), f32 [n, V]."""
    n = len(tokens)
    num_blocks = -(-n // runner.block_size)
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.arange(n, dtype=torch.int64),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n, dtype=torch.int64),
    )
    hidden = runner.forward(batch).hidden_states  # [n, H]
    return torch.log_softmax(runner.compute_logits(hidden).float(), dim=-1)  # [n, V]
