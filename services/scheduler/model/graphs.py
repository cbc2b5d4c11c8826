"""Decode and verify steps over a ladder of padded batch sizes, replayed from CUDA graphs.

A decode step launches ~1.6k small kernels; replaying a captured graph removes the launch gaps.
A step qualifies when every sequence has the same number q of query tokens (q = 1: decode;
q = k + 1: a speculative verify block), so graphs are keyed by (rung, q). `DecodeGraphRunner`
owns static input buffers sized for the largest rung and q. Each step copies the batch into them,
pads up to the next rung (padded sequences: tokens 0 at positions 0..q-1, seq_len q, every block
and slot in the cache's trash block, so their K/V writes never reach a real sequence), then
replays the graph, or, with `capture=False` (the CPU twin CI tests), runs the very same padded
forward eagerly. With `capture_layers` the graphs also return those layers' outputs (DSpark).
Every graph writes its logits into the first rows of one buffer (`SharedOutputs`), not one of its own.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TypeVar

import torch

from services.common.progress import Progress
from services.scheduler.model.attention import MAX_BATCHED_QUERY_LEN, DecodePlan
from services.scheduler.model.batch import ForwardBatch, ForwardOutput
from services.scheduler.model.kv_cache import PagedKVCache
from services.scheduler.model.kv_splits import num_kv_splits
from services.scheduler.model.llama import CausalLM

DEFAULT_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
WIDE_RUNGS = (160, 192, 256, 320, 384, 448, 512)  # past 128: padding <= 25%


def decode_ladder(max_running_requests: int) -> tuple[int, ...]:
    """Decode graphs' batch sizes up to the running limit, which is a rung too."""
    rungs = (*DEFAULT_LADDER, *WIDE_RUNGS)
    return tuple(sorted({r for r in rungs if r < max_running_requests} | {max_running_requests}))
T = TypeVar("T")


def uniform_query_len(batch: ForwardBatch) -> int | None:
    """q when every sequence of the batch has the same short query of q tokens; else None: a ragged
    step (the varlen kernel on CUDA, the SDPA groups elsewhere). Decode attention lets token t of
    sequence b see the keys below seq_lens[b] - q + t % q + 1: that relies on `ForwardBatch`'s
    contract (a sequence's new tokens are the last of its seq_lens[b]), which every builder keeps
    and the twin tests check against eager forwards."""
    if batch.num_tokens == batch.num_seqs:
        return 1
    lens = batch.host_query_lens
    if lens is None or len(set(lens)) != 1 or lens[0] > MAX_BATCHED_QUERY_LEN:
        return None
    return lens[0]



def capture_graph(
    run: Callable[[], T], pool=None, device: torch.device | None = None
) -> tuple[torch.cuda.CUDAGraph, T]:
    """One warm-up call of `run` (Triton compiles, cuBLAS plans, allocator growth), then its capture
    into `pool` (None: a new one; pass `graph.pool()` on to share it); returns (graph, run's static
    outputs). thread_local: graphs captured on first use, in the middle of serving, must not fail on
    another thread's CUDA calls."""
    run()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = run()
    return graph, output


class SharedOutputs:
    """One buffer per output for every graph of a runner, each graph writing the first rows [:n].

    A graph's own outputs would stay allocated in its pool for as long as the graph lives, a sum over
    every key of the ladders (a decode key's f32 logits [rung * q, V], a ragged key's hidden states
    and captures [T, (1 + C) * H]) that the KV budget leaves no room for. Graphs of a runner replay one at a time and a
    step reads its outputs before the next replay (`run`'s contract), so the keys need only one set,
    sized by the most rows any key has. `write` copies into it (as `.float()` would copy: same values)."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.buffers: dict[str, torch.Tensor] = {}

    def write(self, name: str, value: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """value [n, ...] -> buffer `name`'s rows [:n] holding it, in `dtype` (None: value's)."""
        buffer = self.buffers.get(name)
        if buffer is None:  # first written by a capture's eager warm-up: outside any graph pool
            buffer = torch.empty((self.max_rows, *value.shape[1:]), dtype=dtype or value.dtype, device=value.device)
            self.buffers[name] = buffer
        return buffer[: value.shape[0]].copy_(value)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


class DecodeGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        ladder: tuple[int, ...] = DEFAULT_LADDER,
        max_blocks_per_seq: int | None = None,
        capture: bool = True,
        use_kernel: bool = True,
        query_lens: tuple[int, ...] = (1,),
        capture_layers: tuple[int, ...] = (),
        split_sms: int = 0,
    ) -> None:
        """split_sms: the SMs the kernel's split-KV count fills (`ModelRunner.split_sms`; 0: no split)."""
        if not ladder or min(ladder) < 1 or not query_lens or min(query_lens) < 1:
            raise ValueError(f"ladder and query_lens must hold positive sizes, got {ladder}, {query_lens}")
        self.model, self.cache, self.use_kernel, self.split_sms = model, cache, use_kernel, split_sms
        self.ladder = tuple(sorted(set(ladder)))
        self.query_lens = tuple(sorted(set(query_lens)))
        self.capture_layers = tuple(capture_layers)
        self.max_blocks = max_blocks_per_seq or -(-model.config.max_position_embeddings // cache.block_size)
        self._allocate(self.ladder[-1], self.query_lens[-1], cache.kv.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], ForwardOutput] = {}
        self.shared = SharedOutputs(self.ladder[-1] * self.query_lens[-1])  # every key's logits
        if capture:
            self._capture_all()

    def _allocate(self, size: int, max_q: int, device: torch.device) -> None:
        trash = self.cache.trash_block
        tokens = size * max_q
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)  # [R * Q]
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)  # [R * Q]
        self.slot_mapping = torch.full((tokens,), trash * self.cache.block_size, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)  # [R]
        self.block_tables = torch.full((size, self.max_blocks), trash, dtype=torch.int32, device=device)  # [R, M]
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)  # rewritten per q

    def fits(self, batch: ForwardBatch, query_len: int = 1) -> bool:
        return (
            batch.num_seqs <= self.ladder[-1]
            and query_len in self.query_lens
            and batch.block_tables.shape[1] <= self.max_blocks
            and tuple(batch.capture_layers) in ((), self.capture_layers)
        )

    def rung(self, num_seqs: int) -> int:
        return self.ladder[bisect.bisect_left(self.ladder, num_seqs)]

    def run(self, batch: ForwardBatch, query_len: int = 1) -> ForwardOutput:
        """Hidden states [T, H], captures and logits [T, V] of a uniform-query batch that `fits`.

        On CUDA these are views of the graph's static outputs: read them before the next step's replay.
        """
        num_tokens = batch.num_tokens
        rung = self.rung(batch.num_seqs)
        self._load(batch, rung, query_len)
        key = (rung, query_len)
        if key in self.graphs:
            self.graphs[key].replay()
            return head_rows(self.outputs[key], num_tokens, batch)
        return head_rows(self._forward(rung, query_len), num_tokens, batch)

    def _load(self, batch: ForwardBatch, rung: int, query_len: int) -> None:
        num_seqs, num_tokens, width = batch.num_seqs, batch.num_tokens, batch.block_tables.shape[1]
        self.input_ids[:num_tokens].copy_(batch.input_ids)
        self.positions[:num_tokens].copy_(batch.positions)
        self.slot_mapping[:num_tokens].copy_(batch.slot_mapping)
        self.seq_lens[:num_seqs].copy_(batch.seq_lens)
        # Entries past the batch's width keep an earlier step's (valid) ids: the kernel reads only the
        # blocks below each seq_len. Padded rows get the trash block in `_pad`.
        self.block_tables[:num_seqs, :width].copy_(batch.block_tables)
        self._pad(num_seqs, rung, query_len)

    def _pad(self, start: int, rung: int, query_len: int) -> None:
        if start == rung:
            return
        tokens = slice(start * query_len, rung * query_len)
        self.block_tables[start:rung].fill_(self.cache.trash_block)
        self.input_ids[tokens].zero_()
        self.positions[tokens].copy_(torch.arange(query_len, device=self.positions.device).repeat(rung - start))
        self.seq_lens[start:rung].fill_(query_len)
        self.slot_mapping[tokens].fill_(self.cache.trash_block * self.cache.block_size)

    def _static_batch(self, rung: int, query_len: int) -> ForwardBatch:
        num_tokens = rung * query_len
        return ForwardBatch(
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            query_start_loc=self.query_start_loc[: rung + 1],  # unused by the decode plan
            seq_lens=self.seq_lens[:rung],
            block_tables=self.block_tables[:rung],
            slot_mapping=self.slot_mapping[:num_tokens],
            capture_layers=self.capture_layers,
        )

    def plan(self, rung: int, query_len: int) -> DecodePlan:
        """A padded step's plan over the static buffers; its split count from host ints (the rung, the
        buffers' width), so a graph captured for the rung keeps it."""
        splits = num_kv_splits(rung, self.model.config.num_key_value_heads, self.max_blocks, self.split_sms)
        return DecodePlan(self.seq_lens[:rung], self.block_tables[:rung], self.use_kernel, query_len, splits)

    def _forward(self, rung: int, query_len: int) -> ForwardOutput:
        plan = self.plan(rung, query_len)
        hidden, captured = self.model(self._static_batch(rung, query_len), self.cache, plan)  # [rung * q, H]
        # every row of a uniform step is a row the worker verifies: the LM head belongs in the graph
        # (not under tensor parallelism: rows are sampled from vocabulary shards, `ShardedRows`)
        if self.model.tp is not None:
            return ForwardOutput(hidden, captured)
        logits = self.shared.write("logits", self.model.head_logits(hidden), torch.float32)  # `compute_logits`: f32 [rung * q, V]
        return ForwardOutput(hidden, captured, logits)

    def _capture_all(self) -> None:
        # Largest first, all graphs in one memory pool: smaller graphs reuse the largest one's blocks.
        pool = None
        progress = Progress("cuda_graphs.capture", "graphs", len(self.query_lens) * len(self.ladder))
        for query_len in reversed(self.query_lens):
            self._pad(0, self.ladder[-1], query_len)  # every row padded: capture touches the trash block only
            for rung in reversed(self.ladder):
                forward = lambda: self._forward(rung, query_len)  # noqa: E731 (called at once, in this iteration)
                graph, self.outputs[(rung, query_len)] = capture_graph(forward, pool, self.cache.kv.device)
                pool = graph.pool()
                self.graphs[(rung, query_len)] = graph
                progress.advance(rung=rung, query_len=query_len)
        torch.cuda.synchronize(self.cache.kv.device)
        progress.close()


def head_rows(out: ForwardOutput, num_tokens: int, batch: ForwardBatch) -> ForwardOutput:
    """The first `num_tokens` rows of a padded step's static outputs (captures only if the batch asked)."""
    captured = out.captured[:num_tokens] if out.captured is not None and batch.capture_layers else None
    logits = out.logits[:num_tokens] if out.logits is not None else None
    return ForwardOutput(out.hidden_states[:num_tokens], captured, logits, out.logits)
