"""Paged KV cache: fixed-size blocks of K/V slots, owned by the runner, addressed by the scheduler.

One tensor holds every layer: [num_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim].
Slot s of a layer is block s // block_size, offset s % block_size; the scheduler's block manager
decides which blocks a sequence owns and hands the runner `slot_mapping` and `block_tables`.
One extra block past `num_blocks`, the trash block, is never handed out: padded rows of a
CUDA-graph decode write their K/V there, so padding never touches a real sequence.
"""

from __future__ import annotations

import torch

from services.scheduler.model.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * block_size * config.num_key_value_heads * config.head_dim * element_size


def num_blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int, extra_bytes_per_block: int = 0
) -> int:
    """How many blocks fit in `budget_bytes` when each also costs `extra_bytes_per_block` elsewhere
    (a drafter's KV cache); at least one, else the budget is an error."""
    block_bytes = bytes_per_block(config, block_size, dtype) + extra_bytes_per_block
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes holds no block of {block_bytes} bytes")
    return int(num_blocks)


class PagedKVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks  # usable by the scheduler; the trash block comes after them
        self.block_size = block_size
        shape = (config.num_hidden_layers, 2, num_blocks + 1, block_size, config.num_key_value_heads, config.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def trash_block(self) -> int:
        return self.num_blocks

    def key_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]  # [num_blocks, block_size, kv_heads, head_dim]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]  # [num_blocks, block_size, kv_heads, head_dim]

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new tokens' K/V ([T, kv_heads, head_dim] each) at their slots ([T])."""
        kv_heads, head_dim = key.shape[1], key.shape[2]
        slot_mapping = slot_mapping.long()  # int32 slots index too, but not on every torch version
        self.kv[layer, 0].view(-1, kv_heads, head_dim)[slot_mapping] = key
        self.kv[layer, 1].view(-1, kv_heads, head_dim)[slot_mapping] = value

    def gather(self, layer: int, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `seq_len` K and V, each [seq_len, kv_heads, head_dim]."""
        num_blocks = -(-seq_len // self.block_size)
        blocks = block_table[:num_blocks].long()
        key = self.kv[layer, 0, blocks].flatten(0, 1)[:seq_len]
        value = self.kv[layer, 1, blocks].flatten(0, 1)[:seq_len]
        return key, value
