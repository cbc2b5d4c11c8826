"""The scheduler's handle on the model: one ragged forward per step, logits on demand.

The worker builds each `ForwardBatch` from the policy's plan; the runner owns the weights and the
paged KV cache those blocks index into. Steps where every sequence has the same number q of query
tokens (decode, q = 1; speculative verify, q = k + 1) take the sync-free `DecodePlan` path: on
CUDA the Triton paged kernel, replayed from a CUDA graph keyed by (batch rung, q) once
`prepare_decode_graphs` has captured them. Ragged steps (prefill chunks, mixed batches, `compact`
verify blocks of per-request lengths) run on CUDA through the Triton varlen kernel over a
host-built tile map (`VarlenPlan`), elsewhere through the ragged SDPA groups; once
`prepare_ragged_graphs` has been called, those within its ladders are padded to a (sequence rung,
token rung, block_m) key and replayed from CUDA graphs captured on first use (`ragged_graphs.py`).
With `batch_invariant` set (`--deterministic`), every step takes the varlen path with one tile
size and every product is batch-invariant (`batch_invariant.py`): a row's numbers depend on that
row alone, for decode, verify and prefill queries alike.
With `dense_prefill` set, a ragged step's long queries are attended over gathered K/V by
FlashAttention-4 or torch SDPA instead of the varlen kernel (`dense_attention.py`); such steps run
eagerly, never from a graph.
"""

from __future__ import annotations

import dataclasses

import torch

from services.scheduler.flags import DEFAULT_SPLIT_KV_DECODE
from services.scheduler.model.attention import DecodePlan, plan_varlen
from services.scheduler.model.batch import ForwardBatch, ForwardOutput
from services.scheduler.model.batch_invariant import set_batch_invariant
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.dense_attention import DenseConfig
from services.scheduler.model.graphs import DEFAULT_LADDER, DecodeGraphRunner, uniform_query_len
from services.scheduler.model.kv_cache import PagedKVCache
from services.scheduler.model.kv_splits import num_kv_splits
from services.scheduler.model.llama import CausalLM
from services.scheduler.model.ragged_graphs import (
    DEFAULT_MAX_GRAPHS,
    DEFAULT_SEQ_LADDER,
    DEFAULT_TOKEN_LADDER,
    RaggedGraphRunner,
)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def device_sms(device: torch.device) -> int:
    """The SMs split-KV fills on `device`: its multiprocessor count on CUDA, 0 (never split) elsewhere."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        decode_kernel: bool | None = None,
        ragged_kernel: bool | None = None,
        fused_kernels: bool | None = None,
        split_kv_decode: bool = DEFAULT_SPLIT_KV_DECODE,
        num_sms: int | None = None,
        batch_invariant: bool = False,
    ) -> None:
        """decode_kernel: eager uniform-query steps use the Triton decode kernel; ragged_kernel: ragged
        steps use the Triton varlen kernel, not the SDPA groups; fused_kernels: the model's small ops
        (norms, RoPE, the K/V write, SiLU * up) run as the Triton kernels of `triton_fused.py` (each
        default: on CUDA with Triton); split_kv_decode: that decode kernel splits each sequence's keys
        across programs where the batch alone leaves SMs idle (`kv_splits.num_kv_splits`; default on;
        nothing without the decode kernel);
        num_sms: the SMs the split count fills (None: read from the device once, here; 0 off CUDA);
        batch_invariant: every row's numbers its own (`batch_invariant.py`, `--deterministic`), for life."""
        self.model = model
        self.kv_cache = kv_cache
        self.config: ModelConfig = model.config
        self.device: torch.device = kv_cache.kv.device
        self.dtype: torch.dtype = kv_cache.kv.dtype
        self.block_size: int = kv_cache.block_size
        self.num_blocks: int = kv_cache.num_blocks
        on_cuda_with_triton = kv_cache.kv.device.type == "cuda" and triton_available()
        self.decode_kernel = on_cuda_with_triton if decode_kernel is None else decode_kernel
        self.ragged_kernel = on_cuda_with_triton if ragged_kernel is None else ragged_kernel
        self.decode_graphs: DecodeGraphRunner | None = None
        self.ragged_graphs: RaggedGraphRunner | None = None
        self.fused_kernels = on_cuda_with_triton if fused_kernels is None else fused_kernels
        self._split_kv_decode = split_kv_decode
        self._num_sms = device_sms(kv_cache.kv.device) if num_sms is None else num_sms
        self._dense_prefill: DenseConfig | None = None
        self.batch_invariant = batch_invariant
        set_batch_invariant(model, batch_invariant)
        self.leader = None  # rank_group.Leader on rank 0 of a tensor-parallel group: each call sent to the other ranks first
        self.sharded_rows = None  # tensor_parallel.ShardedRows where the LM head holds a vocabulary shard

    def prepare_decode_graphs(
        self,
        ladder: tuple[int, ...] = DEFAULT_LADDER,
        max_blocks_per_seq: int | None = None,
        capture: bool | None = None,
        query_lens: tuple[int, ...] = (1,),
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        """Route uniform-query steps (decode: q = 1; verify: q = k + 1, for each q in `query_lens`) of
        up to max(ladder) sequences through padded static buffers, returning `capture_layers` too.

        capture None: capture CUDA graphs when the kernel path is on (CUDA with Triton); False keeps
        the padded eager twin (what CI tests on CPU). Call once at start-up, before serving.
        """
        capture = self.decode_kernel if capture is None else capture
        with torch.inference_mode():
            self.decode_graphs = DecodeGraphRunner(
                self.model, self.kv_cache, ladder, max_blocks_per_seq, capture=capture, use_kernel=self.decode_kernel,
                query_lens=query_lens, capture_layers=capture_layers, split_sms=self.split_sms,
            )  # fmt: skip

    def drop_decode_graphs(self) -> None:
        self.decode_graphs = None

    def prepare_ragged_graphs(
        self,
        seq_ladder: tuple[int, ...] = DEFAULT_SEQ_LADDER,
        token_ladder: tuple[int, ...] = DEFAULT_TOKEN_LADDER,
        max_blocks_per_seq: int | None = None,
        capture: bool | None = None,
        capture_layers: tuple[int, ...] = (),
        max_graphs: int = DEFAULT_MAX_GRAPHS,
    ) -> None:
        """Route ragged steps of up to max(seq_ladder) sequences and max(token_ladder) tokens through
        padded static buffers on the varlen plan, returning `capture_layers` too.

        capture None: capture CUDA graphs (lazily, on each key's first use) when the varlen kernel is
        on; False keeps the padded eager twin (what CI tests on CPU). Capture needs the kernel: the
        SDPA groups build index tensors per step.
        """
        capture = self.ragged_kernel if capture is None else capture
        if capture and not self.ragged_kernel:
            raise ValueError("capturing ragged steps needs the varlen kernel (ragged_kernel)")
        self.ragged_graphs = RaggedGraphRunner(
            self.model, self.kv_cache, seq_ladder, token_ladder, max_blocks_per_seq, capture=capture,
            use_kernel=self.ragged_kernel, capture_layers=capture_layers, max_graphs=max_graphs, split_sms=self.split_sms,
        )  # fmt: skip

    def drop_ragged_graphs(self) -> None:
        self.ragged_graphs = None

    @property
    def fused_kernels(self) -> bool:
        return self.model.fused_kernels

    @fused_kernels.setter
    def fused_kernels(self, on: bool) -> None:
        """Only while no graph is captured: a captured graph would go on replaying the kernels it was
        captured with (drop the graphs, switch, prepare them again)."""
        if on != self.model.fused_kernels and (self.decode_graphs is not None or self.ragged_graphs is not None):
            raise RuntimeError("fused_kernels switched with CUDA graphs captured: drop them first")
        self.model.fused_kernels = on

    @property
    def dense_prefill(self) -> DenseConfig | None:
        """Long queries of ragged steps on the kernel path attended densely (`dense_attention.py`);
        None: off (`build_core` sets it, `--dense-prefill`). Graphs capture no dense call, so this
        may be switched at any time."""
        return self._dense_prefill

    @dense_prefill.setter
    def dense_prefill(self, config: DenseConfig | None) -> None:
        # FA4 and SDPA are called there without sliding windows or soft-capping (SDPA has no softcap):
        # such models' long queries stay on the varlen kernel, which takes both.
        self._dense_prefill = None if self.config.has_windows_or_softcap else config

    @property
    def split_kv_decode(self) -> bool:
        return self._split_kv_decode

    @split_kv_decode.setter
    def split_kv_decode(self, on: bool) -> None:
        """Only while no decode graph is captured, for the reason `fused_kernels` gives."""
        if on != self._split_kv_decode and self.decode_graphs is not None:
            raise RuntimeError("split_kv_decode switched with decode graphs captured: drop them first")
        self._split_kv_decode = on

    @property
    def split_sms(self) -> int:
        """The SMs each decode plan's split count fills: 0 (one program per (sequence, kv head)) with
        split-KV off or without the decode kernel."""
        return self._num_sms if self.split_kv_decode and self.decode_kernel else 0

    def decode_plan(self, batch: ForwardBatch, query_len: int) -> DecodePlan:
        """An eager uniform-query step's kernel plan; its split count from host shapes alone."""
        splits = num_kv_splits(batch.num_seqs, self.config.num_key_value_heads, batch.block_tables.shape[1], self.split_sms)
        return DecodePlan(batch.seq_lens, batch.block_tables, True, query_len, splits)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head_weight  # [V, H]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one step: write the new tokens' K/V, return final hidden states [T, H] (+ captures)."""
        self._check(batch)
        if self.leader is not None:
            self.leader.forward(batch)
        batch = self._on_device(batch)
        query_len = None if self.batch_invariant else uniform_query_len(batch)  # invariant: one attention order for all
        if query_len is not None and self.decode_graphs is not None and self.decode_graphs.fits(batch, query_len):
            return self.decode_graphs.run(batch, query_len)
        graphable = self.ragged_graphs is not None and not _has_dense_query(self.dense_prefill, batch)
        ragged = query_len is None or _uncaptured_verify(self.decode_graphs, query_len)
        if ragged and graphable and self.ragged_graphs.fits(batch):
            return self.ragged_graphs.run(batch)
        if query_len is not None and self.decode_kernel:
            return ForwardOutput(*self.model(batch, self.kv_cache, self.decode_plan(batch, query_len)))
        if query_len is None and (self.ragged_kernel or self.batch_invariant):
            plan = plan_varlen(batch, self.config.num_queries_per_kv, use_kernel=self.ragged_kernel, dense=self.dense_prefill,
                               invariant=self.batch_invariant, split_sms=self.split_sms,
                               num_kv_heads=self.config.num_key_value_heads)  # fmt: skip
            return ForwardOutput(*self.model(batch, self.kv_cache, plan))
        hidden, captured = self.model(batch, self.kv_cache)
        return ForwardOutput(hidden_states=hidden, captured=captured)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_logits(hidden).float()  # [N, V] float32

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head alone: [N, V] in the model's dtype (prompt logprobs' chunks: the fused kernels read it as is)."""
        hidden = hidden.to(self.device, self.dtype)
        if self.leader is not None:
            self.leader.head(hidden)
        return self.model.head_logits(hidden)

    @torch.inference_mode()
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids.to(self.device))  # [..., H]

    def _on_device(self, batch: ForwardBatch) -> ForwardBatch:
        if batch.input_ids.device == self.device:
            return batch
        fields = ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping")
        moved = {name: getattr(batch, name).to(self.device, non_blocking=True) for name in fields}
        return dataclasses.replace(batch, **moved)

    def _check(self, batch: ForwardBatch) -> None:
        num_tokens = batch.num_tokens
        if batch.positions.shape[0] != num_tokens or batch.slot_mapping.shape[0] != num_tokens:
            raise ValueError(
                f"input_ids, positions and slot_mapping must have one entry per token ({num_tokens}); got "
                f"{batch.positions.shape[0]} positions and {batch.slot_mapping.shape[0]} slots"
            )
        if batch.query_start_loc.shape[0] != batch.num_seqs + 1:
            raise ValueError(f"query_start_loc needs {batch.num_seqs + 1} entries, got {batch.query_start_loc.shape[0]}")
        bad = [i for i in batch.capture_layers if not -1 <= i < self.config.num_hidden_layers]  # -1: the embedding
        if bad:
            raise ValueError(f"capture_layers {bad} out of range for {self.config.num_hidden_layers} layers")


def _uncaptured_verify(graphs: DecodeGraphRunner | None, query_len: int) -> bool:
    """A uniform verify narrower than the widest captured one (`compact` cut every block alike, as at
    batch 1): the ragged graphs take it, keyed by its total tokens, rather than an eager forward."""
    return graphs is not None and 1 < query_len < graphs.query_lens[-1]


def _has_dense_query(dense: DenseConfig | None, batch: ForwardBatch) -> bool:
    """A query the dense path takes: the ragged graphs' token ladder reaches the chunk budget, so
    prefill chunks of 512 tokens and more do fit captured shapes, but a dense call's shapes change
    with every step (gathered keys: seq_len), so such a step runs eagerly. Without host lengths no
    graph fits anyway."""
    if dense is None or batch.host_query_lens is None:
        return False
    return max(batch.host_query_lens, default=0) >= dense.min_query_len
