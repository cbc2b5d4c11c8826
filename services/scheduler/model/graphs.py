"""Decode over a ladder of padded batch sizes, replayed from CUDA graphs.

A decode step launches ~1.6k small kernels; replaying a captured graph removes the launch gaps.
`DecodeGraphRunner` owns static input buffers sized for the largest ladder rung. Each step copies
the batch into them, pads up to the next rung (padded rows: token 0 at position 0, seq_len 1, every
block and slot in the cache's trash block, so their K/V writes never reach a real sequence), then
replays the rung's graph, or, with `capture=False` (the CPU twin CI tests), runs the very same
padded forward eagerly.
"""

from __future__ import annotations

import bisect

import torch

from services.scheduler.model.attention import DecodePlan
from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.kv_cache import PagedKVCache
from services.scheduler.model.llama import CausalLM

DEFAULT_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def is_pure_decode(batch: ForwardBatch) -> bool:
    """One new token per sequence (every query is >= 1 token, so T == B says all are 1): no host sync."""
    return batch.num_tokens == batch.num_seqs and not batch.capture_layers


class DecodeGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        ladder: tuple[int, ...] = DEFAULT_LADDER,
        max_blocks_per_seq: int | None = None,
        capture: bool = True,
        use_kernel: bool = True,
    ) -> None:
        if not ladder or min(ladder) < 1:
            raise ValueError(f"ladder must hold positive batch sizes, got {ladder}")
        self.model, self.cache, self.use_kernel = model, cache, use_kernel
        self.ladder = tuple(sorted(set(ladder)))
        self.max_blocks = max_blocks_per_seq or -(-model.config.max_position_embeddings // cache.block_size)
        self._allocate(self.ladder[-1], cache.kv.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # rung -> static hidden [rung, H]
        if capture:
            self._capture_all()

    def _allocate(self, size: int, device: torch.device) -> None:
        trash = self.cache.trash_block
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)  # [R]
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)  # [R]
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)  # [R]
        self.slot_mapping = torch.full((size,), trash * self.cache.block_size, dtype=torch.int64, device=device)
        self.block_tables = torch.full((size, self.max_blocks), trash, dtype=torch.int32, device=device)  # [R, M]
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)  # [R + 1]

    def fits(self, batch: ForwardBatch) -> bool:
        return batch.num_seqs <= self.ladder[-1] and batch.block_tables.shape[1] <= self.max_blocks

    def rung(self, num_seqs: int) -> int:
        return self.ladder[bisect.bisect_left(self.ladder, num_seqs)]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [B, H] of a pure-decode batch that `fits`."""
        num_seqs = batch.num_seqs
        rung = self.rung(num_seqs)
        self._load(batch, rung)
        if rung in self.graphs:
            self.graphs[rung].replay()
            return self.outputs[rung][:num_seqs].clone()  # the next replay overwrites the static output
        return self._forward(rung)[:num_seqs]

    def _load(self, batch: ForwardBatch, rung: int) -> None:
        num_seqs, width = batch.num_seqs, batch.block_tables.shape[1]
        trash = self.cache.trash_block
        self.input_ids[:num_seqs].copy_(batch.input_ids)
        self.positions[:num_seqs].copy_(batch.positions)
        self.seq_lens[:num_seqs].copy_(batch.seq_lens)
        self.slot_mapping[:num_seqs].copy_(batch.slot_mapping)
        self.block_tables[:rung].fill_(trash)
        tables = batch.block_tables
        self.block_tables[:num_seqs, :width].copy_(tables.masked_fill(tables < 0, trash))
        self._pad(num_seqs, rung)

    def _pad(self, start: int, rung: int) -> None:
        if start == rung:
            return
        self.input_ids[start:rung].zero_()
        self.positions[start:rung].zero_()
        self.seq_lens[start:rung].fill_(1)
        self.slot_mapping[start:rung].fill_(self.cache.trash_block * self.cache.block_size)

    def _static_batch(self, rung: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:rung],
            positions=self.positions[:rung],
            query_start_loc=self.query_start_loc[: rung + 1],
            seq_lens=self.seq_lens[:rung],
            block_tables=self.block_tables[:rung],
            slot_mapping=self.slot_mapping[:rung],
        )

    def _forward(self, rung: int) -> torch.Tensor:
        plan = DecodePlan(self.seq_lens[:rung], self.block_tables[:rung], self.use_kernel)
        hidden, _ = self.model(self._static_batch(rung), self.cache, plan)
        return hidden  # [rung, H]

    def _capture_all(self) -> None:
        # Largest first, all rungs in one memory pool: smaller graphs reuse the largest one's blocks.
        self._pad(0, self.ladder[-1])  # every row padded: warm-up and capture touch the trash block only
        pool = None
        for rung in reversed(self.ladder):
            self._forward(rung)  # warm-up: Triton compile, cuBLAS plan selection, allocator growth
            torch.cuda.synchronize(self.cache.kv.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[rung] = self._forward(rung)
            pool = graph.pool()
            self.graphs[rung] = graph
        torch.cuda.synchronize(self.cache.kv.device)
