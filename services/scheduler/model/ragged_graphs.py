"""Ragged steps (prefill chunks, mixed prefill + decode batches, `compact` verify blocks) replayed
from CUDA graphs over padded static buffers.

Eagerly, a ragged step is host-bound (36 layers x ~40 ops, each launched from Python); replaying
a graph takes those launches off the host. The varlen kernel (`triton_varlen.py`) reads everything
it needs from device tensors and a host-built tile map, so it can be captured with a fixed grid.
Graphs are keyed by (sequence rung S, token rung T, block_m, and in the deterministic mode the
key-split count, `kv_splits.invariant_kv_splits`):

- tokens are padded up to T (token ids 0, position 0, K/V written to the cache's trash block) and
  belong to no sequence: no tile covers them, the kernel stores nothing for them, and every other
  op is row-wise, so they touch no real row;
- sequences are padded up to S + 1 with empty ones (query length 0, seq_len 0); sequence S is
  always empty, and the tile map (built on the host, `VarlenPlan`) is padded up to the key's worst
  case, ceil(T / block_m) + S tiles, with no-op tiles (sequence S, first query 0), which read and
  store nothing;
- block_m is the one the eager path would pick for the step's longest query (`tile_tokens`),
  computed from host lengths like the rungs: powers of two up to 128 / group (1 .. 32 for the 8B
  shape); a step with a prefill chunk of 32+ tokens takes the largest.

The LM head stays outside: a ragged step needs logits for a few rows only (each sampling chunk's
last token, decode and verify rows, prompt-logprob rows), which the worker picks and projects
eagerly (`runner.compute_logits`); the graphs return hidden states [T, H] and the captured layers.

Capture is lazy, on a key's first use: the key set is the product of three ladders, most of which
a workload never visits, and capturing all of it at start-up would cost seconds and one output
buffer per key. `capture_prefill_keys` captures, at start-up, the keys of steps that carry a prefill
chunk of 32+ tokens (the largest block_m, every sequence and token rung): those are the ones a
burst of arrivals visits while other requests decode, and a capture mid-serving pauses them all
(and one key of each smaller block_m, `block_size_keys`: a variant's first compile is the slow part);
likewise `verify_keys` under `compact`, whose steps are ragged verify blocks keyed by their total
tokens (and uniform ones narrower than the decode graphs' widths, which the runner sends here).
A capture costs one eager warm-up forward plus the capture, once per key; it runs with every row
padded, so it writes the trash block only. All graphs share one memory pool (intermediates are
reused between keys) and write their outputs, [T, H] and the captures, into the first T rows of one
set of buffers (`SharedOutputs`): a key holds none of its own.
After `max_graphs` captures, steps of new keys are not taken (`fits`); a capture that fails is
logged and its key left eager. Each capture is logged (`cuda_graphs.ragged_capture.done`, with its
key). With `capture=False` (the CPU twin CI tests) the very same padded forward runs eagerly, on the
varlen torch twin.
"""

from __future__ import annotations

import bisect
import time
import dataclasses
from dataclasses import dataclass

import structlog
import torch

from services.common.progress import Progress
from services.scheduler.model.attention import MAX_TILE_ROWS, VarlenPlan, query_tiles, tile_tokens
from services.scheduler.model.batch import ForwardBatch, ForwardOutput
from services.scheduler.model.graphs import SharedOutputs, capture_graph, head_rows
from services.scheduler.model.kv_cache import PagedKVCache
from services.scheduler.model.kv_splits import KV_SPLIT_TOKENS, invariant_kv_splits
from services.scheduler.model.llama import CausalLM

DEFAULT_SEQ_LADDER = (1, 2, 4, 8, 16, 32, 64, 128)
# Token rungs up to 1024: 1.5x steps past 256 (padding <= 50%). Past 1024 a step is compute-bound
# (its GEMMs run on every padded row), so `token_ladder` adds FINE_RUNGS_PER_OCTAVE rungs per
# doubling there: padding <= 25%, <= 12.5% near the top of each octave. Mixed steps seldom fill the
# budget, so with the budget as the only rung past 1024 their GEMMs ran on much padding, and a
# budget above 2048 had no rung between 2048 and itself (a 3,000-token step at an 8192 budget ran
# 8192 rows).
COARSE_TOKEN_RUNGS = (64, 128, 256, 384, 512, 768, 1024)
FINE_RUNGS_PER_OCTAVE = 4
DEFAULT_MAX_GRAPHS = 160  # the prefill keys captured at start-up (77 at the default budgets, 133 at 8192) and room for others

log = structlog.get_logger(__name__)


def seq_ladder(max_running_requests: int, ladder: tuple[int, ...] = DEFAULT_SEQ_LADDER) -> tuple[int, ...]:
    """The rungs up to the most sequences a step can hold, which is a rung too."""
    return tuple(sorted({r for r in ladder if r < max_running_requests} | {max_running_requests}))


def token_ladder(chunk_budget: int, ladder: tuple[int, ...] = COARSE_TOKEN_RUNGS) -> tuple[int, ...]:
    """The rungs up to the scheduler's tokens per step (its chunked-prefill budget), which is a rung
    too: `ladder`'s, then past its top FINE_RUNGS_PER_OCTAVE evenly spaced rungs per doubling.
    (Stopping the graphs at 2048 tokens whatever the budget, so that larger steps ran eagerly,
    served large chunk budgets far slower.)"""
    rungs = {r for r in ladder if r < chunk_budget}
    octave = max(ladder)
    while octave < chunk_budget:
        step = octave // FINE_RUNGS_PER_OCTAVE
        rungs |= {r for r in range(octave + step, 2 * octave + 1, step) if r < chunk_budget}
        octave *= 2
    return tuple(sorted(rungs | {chunk_budget}))


DEFAULT_TOKEN_LADDER = token_ladder(2048)  # the default chunk budget's (flags.DEFAULT_CHUNKED_PREFILL_SIZE)


@dataclass(frozen=True)
class RaggedKey:
    num_seqs: int  # sequence rung S; the graph holds S + 1 sequences, the last always empty
    num_tokens: int  # token rung T
    block_m: int  # query tokens per tile
    kv_splits: int = 1  # deterministic mode: programs per tile along the keys, a power of two (`kv_splits`)

    @property
    def num_tiles(self) -> int:
        """Worst case over steps of this key: a sequence of q tokens takes ceil(q / block_m) tiles."""
        return -(-self.num_tokens // self.block_m) + self.num_seqs


def padded_tiles(query_lens: list[int], seq_lens: list[int], key: RaggedKey) -> torch.Tensor:
    """int32 [2, key.num_tiles]: the step's tiles, heaviest first, then no-op tiles on the empty
    sequence key.num_seqs (query length 0, seq_len 0: the kernel reads and stores nothing)."""
    tiles = query_tiles(query_lens, seq_lens, key.block_m)
    tiles += [(key.num_seqs, 0)] * (key.num_tiles - len(tiles))
    return torch.tensor(tiles, dtype=torch.int32).T.contiguous()


class RaggedGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        seq_ladder: tuple[int, ...] = DEFAULT_SEQ_LADDER,
        token_ladder: tuple[int, ...] = DEFAULT_TOKEN_LADDER,
        max_blocks_per_seq: int | None = None,
        capture: bool = True,
        use_kernel: bool = True,
        capture_layers: tuple[int, ...] = (),
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        max_tile_rows: int = MAX_TILE_ROWS,
        split_sms: int = 0,
    ) -> None:
        """split_sms: the deterministic mode's plans spread a tile's key splits over the SMs the tiles
        leave idle (`kv_splits.invariant_kv_splits`); the split count is part of the key (a power of
        two from the step's longest sequence), so a graph's grid and partials fit the step."""
        if not seq_ladder or min(seq_ladder) < 1 or not token_ladder or min(token_ladder) < 1:
            raise ValueError(f"ladders must hold positive sizes, got {seq_ladder}, {token_ladder}")
        self.model, self.cache, self.capture, self.use_kernel = model, cache, capture, use_kernel
        self.seq_ladder, self.token_ladder = tuple(sorted(set(seq_ladder))), tuple(sorted(set(token_ladder)))
        self.capture_layers, self.max_graphs, self.max_tile_rows = tuple(capture_layers), max_graphs, max_tile_rows
        self.split_sms = split_sms
        self.group = model.config.num_queries_per_kv
        self.max_blocks = max_blocks_per_seq or -(-model.config.max_position_embeddings // cache.block_size)
        self._allocate(self.seq_ladder[-1] + 1, self.token_ladder[-1], cache.kv.device)
        self.graphs: dict[RaggedKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[RaggedKey, ForwardOutput] = {}
        self.shared = SharedOutputs(self.token_ladder[-1])  # every key's hidden states and captures
        self.capture_seconds: dict[RaggedKey, float] = {}
        self.failed: set[RaggedKey] = set()  # keys whose capture raised: never tried again
        self._pool = None

    def _allocate(self, seqs: int, tokens: int, device: torch.device) -> None:
        trash = self.cache.trash_block
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)  # [T]
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)  # [T]
        self.slot_mapping = torch.full((tokens,), trash * self.cache.block_size, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)  # [S + 2]
        self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)  # [S + 1]
        self.block_tables = torch.full((seqs, self.max_blocks), trash, dtype=torch.int32, device=device)  # [S + 1, M]
        max_tiles = max(RaggedKey(self.seq_ladder[-1], tokens, 1).num_tiles, 1)
        self.tiles = torch.zeros(2 * max_tiles, dtype=torch.int32, device=device)  # viewed [2, key.num_tiles]

    def fits(self, batch: ForwardBatch) -> bool:
        """Host lengths present (the key is read from them), within the ladders and table width, and,
        when capturing, a key captured already or room for one more: past `max_graphs` a new key
        takes the unpadded eager path, which is cheaper than the padded one."""
        within = (
            batch.host_query_lens is not None
            and batch.host_seq_lens is not None
            and batch.num_seqs <= self.seq_ladder[-1]
            and batch.num_tokens <= self.token_ladder[-1]
            and batch.block_tables.shape[1] <= self.max_blocks
            and tuple(batch.capture_layers) in ((), self.capture_layers)
        )
        if not within or not self.capture:
            return within
        key = self.key(batch)
        return key in self.graphs or (key not in self.failed and len(self.graphs) < self.max_graphs)

    def key(self, batch: ForwardBatch) -> RaggedKey:
        seqs = self.seq_ladder[bisect.bisect_left(self.seq_ladder, batch.num_seqs)]
        tokens = self._token_rung(batch.num_tokens)
        longest = self.max_tile_rows if self.model.batch_invariant else max(batch.host_query_lens)  # invariant: one tile size
        key = RaggedKey(seqs, tokens, tile_tokens(longest, self.group, self.max_tile_rows))
        if not self.model.batch_invariant:
            return key
        splits = -(-max(batch.host_seq_lens) // KV_SPLIT_TOKENS)  # the longest sequence's, rounded up to a power of two
        max_keys = KV_SPLIT_TOKENS << max(0, splits - 1).bit_length()
        heads = self.model.config.num_key_value_heads
        return dataclasses.replace(key, kv_splits=invariant_kv_splits(key.num_tiles, heads, tokens, max_keys, self.split_sms))

    def run(self, batch: ForwardBatch) -> ForwardOutput:
        """Hidden states [T, H] and captures of a ragged batch that `fits`; logits None (the caller
        projects the rows it needs). On CUDA these are views of the graph's static outputs: read
        them before the next step's replay."""
        key = self.key(batch)
        if self.capture and key not in self.graphs and key not in self.failed:
            self._try_capture(key)
        self._load(batch, key)
        if key in self.graphs:
            self.graphs[key].replay()
            return head_rows(self.outputs[key], batch.num_tokens, batch)
        return head_rows(self._forward(key), batch.num_tokens, batch)

    def _load(self, batch: ForwardBatch, key: RaggedKey) -> None:
        num_seqs, num_tokens, width = batch.num_seqs, batch.num_tokens, batch.block_tables.shape[1]
        self.input_ids[:num_tokens].copy_(batch.input_ids)
        self.positions[:num_tokens].copy_(batch.positions)
        self.slot_mapping[:num_tokens].copy_(batch.slot_mapping)
        self.query_start_loc[: num_seqs + 1].copy_(batch.query_start_loc)
        self.seq_lens[:num_seqs].copy_(batch.seq_lens)
        # Entries past the batch's width keep an earlier step's (valid) ids: the kernel reads only the
        # blocks below each seq_len. Padded sequences are empty: nothing reads their tables.
        self.block_tables[:num_seqs, :width].copy_(batch.block_tables)
        tiles = padded_tiles(list(batch.host_query_lens), list(batch.host_seq_lens), key).view(-1)
        if tiles.device != self.tiles.device and self.tiles.is_cuda:
            tiles = tiles.pin_memory()
        self.tiles[: tiles.numel()].copy_(tiles, non_blocking=True)
        self._pad(num_seqs, num_tokens, key)

    def _pad(self, num_seqs: int, num_tokens: int, key: RaggedKey) -> None:
        self.query_start_loc[num_seqs + 1 : key.num_seqs + 2].fill_(num_tokens)
        self.seq_lens[num_seqs : key.num_seqs + 1].zero_()
        self.input_ids[num_tokens : key.num_tokens].zero_()
        self.positions[num_tokens : key.num_tokens].zero_()
        self.slot_mapping[num_tokens : key.num_tokens].fill_(self.cache.trash_block * self.cache.block_size)

    def _plan(self, key: RaggedKey) -> VarlenPlan:
        seqs = key.num_seqs + 1
        tiles = self.tiles[: 2 * key.num_tiles].view(2, key.num_tiles)  # [2, num_tiles]
        tensors = (self.query_start_loc[: seqs + 1], self.seq_lens[:seqs], self.block_tables[:seqs])
        return VarlenPlan(*tensors, tiles, key.block_m, self.use_kernel, invariant=self.model.batch_invariant,
                          num_kv_splits=key.kv_splits)  # fmt: skip

    def _static_batch(self, key: RaggedKey) -> ForwardBatch:
        seqs, tokens = key.num_seqs + 1, key.num_tokens
        return ForwardBatch(
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            query_start_loc=self.query_start_loc[: seqs + 1],
            seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs],
            slot_mapping=self.slot_mapping[:tokens],
            capture_layers=self.capture_layers,
        )

    def _forward(self, key: RaggedKey) -> ForwardOutput:
        hidden, captured = self.model(self._static_batch(key), self.cache, self._plan(key))  # [T, H]
        captured = None if captured is None else self.shared.write("captured", captured)  # [T, C * H]
        return ForwardOutput(self.shared.write("hidden", hidden), captured)

    def prefill_keys(self) -> list[RaggedKey]:
        """Keys of steps with a prefill chunk of at least `max_tile_rows / group` tokens: the largest
        block_m, for every sequence rung and every token rung that can hold as many sequences."""
        block_m = tile_tokens(self.token_ladder[-1], self.group, self.max_tile_rows)
        keys = [RaggedKey(s, t, block_m) for s in self.seq_ladder for t in self.token_ladder if t >= max(s, block_m)]
        return keys[: self.max_graphs]

    def block_size_keys(self) -> list[RaggedKey]:
        """One key for each smaller block_m (the fewest sequences, the smallest token rung that holds it):
        capturing it compiles that block_m's kernel variant, which otherwise compiles inside the first
        step that needs one (a prefix-cache hit's short tail, a verify block) and pauses every request."""
        largest = tile_tokens(self.token_ladder[-1], self.group, self.max_tile_rows)
        sizes = sorted({tile_tokens(1 << bits, self.group, self.max_tile_rows) for bits in range(largest.bit_length())} - {largest})
        return [RaggedKey(self.seq_ladder[0], self._token_rung(max(size, self.seq_ladder[0])), size) for size in sizes]

    def verify_keys(self, width: int) -> list[RaggedKey]:
        """Keys of `compact` verify steps: S sequences (a rung) of 1 .. `width` tokens each, the longest
        at least 2 (else the step is a uniform decode), so their total tokens' rungs run from that of
        the fewest sequences the rung holds to that of S * width."""
        blocks = sorted({tile_tokens(q, self.group, self.max_tile_rows) for q in range(2, width + 1)})
        keys, fewest = [], 1
        for seqs in self.seq_ladder:
            low, high = self._token_rung(fewest), self._token_rung(min(seqs * width, self.token_ladder[-1]))
            keys += [RaggedKey(seqs, t, b) for t in self.token_ladder if low <= t <= high for b in blocks]
            fewest = seqs + 1
        return keys

    def _token_rung(self, num_tokens: int) -> int:
        return self.token_ladder[bisect.bisect_left(self.token_ladder, num_tokens)]

    def capture_prefill_keys(self) -> int:
        """Capture `prefill_keys()` and `block_size_keys()` now (start-up), with progress; the number
        captured. No-op without capture."""
        return self.capture_keys(self.prefill_keys() + self.block_size_keys(), "prefill")

    def capture_keys(self, keys: list[RaggedKey], what: str) -> int:
        """Capture `keys` now (start-up) while `max_graphs` leaves room, with progress; the number captured.
        Running out of memory here raises: a server that starts this short of memory fails its first
        steps (their cuBLAS handles, their logits), so it should not start."""
        if not self.capture:
            return 0
        keys = [k for k in keys if k not in self.graphs and k not in self.failed][: max(0, self.max_graphs - len(self.graphs))]
        progress = Progress(f"cuda_graphs.ragged_{what}_capture", "graphs", len(keys))
        for key in keys:
            if isinstance(error := self._try_capture(key, logged=False), torch.cuda.OutOfMemoryError):
                progress.close()
                raise error
            progress.advance()
        progress.close()
        return sum(key in self.graphs for key in keys)

    def _try_capture(self, key: RaggedKey, logged: bool = True) -> Exception | None:
        """A capture that fails (out of memory, an op that cannot be captured) costs this step its
        graph, not the server: the step runs the padded path eagerly, the key is not tried again.
        Returns the failure (None: captured)."""
        progress = Progress("cuda_graphs.ragged_capture", "graphs", 1, num_seqs=key.num_seqs, num_tokens=key.num_tokens,
                            block_m=key.block_m) if logged else None  # fmt: skip
        try:
            self._capture(key)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            self.failed.add(key)
            self.graphs.pop(key, None)
            self.outputs.pop(key, None)
            log.warning("cuda_graphs.ragged_capture.failed", error=str(exc)[:300], **dataclasses.asdict(key))
            return exc
        if progress is not None:
            progress.advance()
            progress.close()
        return None

    def _capture(self, key: RaggedKey) -> None:
        # Every row padded and every tile a no-op: the warm-up and the capture write the trash block only.
        started = time.monotonic()
        self._pad(0, 0, key)
        tiles = self.tiles[: 2 * key.num_tiles].view(2, key.num_tiles)
        tiles[0].fill_(key.num_seqs)
        tiles[1].zero_()
        graph, self.outputs[key] = capture_graph(lambda: self._forward(key), self._pool, self.cache.kv.device)
        self._pool = graph.pool()  # one pool for every key: intermediates are shared
        self.graphs[key] = graph
        torch.cuda.synchronize(self.cache.kv.device)
        self.capture_seconds[key] = time.monotonic() - started

