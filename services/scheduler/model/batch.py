"""The contract between the scheduler core and the model runner: one ragged forward batch.

All sequences of a step (prefill chunks, decode tokens, speculative verify blocks) are flattened
into T new tokens. Sequence b owns new tokens `query_start_loc[b]:query_start_loc[b+1]` and, after
the step, `seq_lens[b]` tokens of KV (its cached prefix plus its new tokens). New token t's K/V is
written to cache slot `slot_mapping[t]` = block_id * block_size + offset. Rolling back rejected
speculative tokens is only a matter of the scheduler lowering its own length counter: stale slots
are overwritten by the next write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T], position of each new token in its sequence
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B], KV length of each sequence after this step
    # int32 [B, max_blocks_per_seq]; entries past a sequence's own blocks hold a valid block id that no
    # sequence owns: the KV cache's trash block (graphs copy tables as they are, with no fix-up kernel)
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor  # int64 [T]
    capture_layers: tuple[int, ...] = ()  # layer indices whose outputs to return (DSpark context)
    # The same lengths as host tuples, when the caller has them: planning attention then reads
    # nothing back from the device.
    host_query_lens: tuple[int, ...] | None = None  # [B]
    host_seq_lens: tuple[int, ...] | None = None  # [B]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True)
class ForwardOutput:
    hidden_states: torch.Tensor  # [T, H], after the final norm, in the model dtype
    captured: torch.Tensor | None = None  # [T, len(capture_layers) * H], or None
    logits: torch.Tensor | None = None  # f32 [T, V], when the step replayed a graph that computes them
    # f32 [R, V]: on a decode graph step, the graph's whole static logits (`logits` is its first T
    # rows; rows past them are its padded rows'): a buffer that stays put, which
    # `LogprobGraphs.greedy` reads in place. None on any other step.
    static_logits: torch.Tensor | None = None
