"""The scheduler's configuration: one frozen dataclass, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.connection import NatsConnection
from services.models import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL
from services.scheduler.flags import (
    CUDA_KV_CACHE_FRACTION,
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_SPLIT_KV_DECODE,
    DENSE_ATTENTION_CHOICES,
    DEVICES,
    DRAFTER_KV_CACHE_FRACTION,
    DTYPE_NAMES,
    LOAD_FORMATS,
    LOGPROBS_MODES,
    QUANTIZATIONS,
    SPECULATIVE_ALGORITHMS,
    VERIFY_MODES,
)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class SchedulerConfig:
    model: str = str(BUNDLED_MODEL)
    draft_model: str | None = None  # None with dspark: the bundled drafter
    speculative_algorithm: str = "none"
    num_draft_tokens: int | None = None  # gamma; None: the drafter's block size
    draft_context_window: int | None = None  # None: the draft config's; 0: the whole context
    verify_mode: str = "static"  # static: verify every draft; compact: by the confidence head
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str | None = None  # None: float32 on cpu, bfloat16 on cuda
    load_format: str = "auto"
    quantization: str | None = None  # one of QUANTIZATIONS: quantized at load; None: the checkpoint's own
    max_running_requests: int | None = None  # None: from the KV cache on CUDA (`build.default_max_running`), else the default
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE
    max_prefill_tokens: int | None = None  # tokens per step while nothing decodes (`Policy`); None: `resolved_max_prefill_tokens`
    prefix_caching: bool = True  # full KV blocks kept and shared across requests (`prefix_cache.py`)
    overlap_decode: bool = True  # `SchedulerCore`: the next decode step launched before this one's readback
    deterministic: bool = False  # batch-invariant numerics (`ModelRunner.batch_invariant`)
    ragged_cuda_graphs: bool = True  # CUDA with Triton: ragged steps replay graphs
    logprob_cuda_graphs: bool = True  # CUDA: output logprobs replay graphs (`LogprobGraphs`; exact against eager)
    # CUDA, with them: greedy decode steps' tokens and rows from one graph (`LogprobGraphs.greedy`);
    # bit-identical, and less host time a step
    greedy_logprob_graphs: bool = True
    fused_kernels: bool = True  # CUDA with Triton: triton_fused.py's kernels
    fused_logprobs: bool = True  # CUDA with Triton: raw-mode logprobs from triton_logprobs.py's kernels
    dense_prefill: bool = True  # CUDA: steps past the chunk budget attend long queries densely (`dense_attention.py`)
    dense_attention: str = "auto"  # that path's kernel, one of DENSE_ATTENTION_CHOICES (`dense_attention.resolve_dense_kernel`)
    split_kv_decode: bool = DEFAULT_SPLIT_KV_DECODE  # CUDA with Triton: split-KV decode attention
    kv_block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_bytes
    kv_cache_bytes: int | None = None  # the target's and a drafter's KV caches together; None: the runner's default budget
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    logprobs_mode: str = "raw"
    seed: int = 0
    instance_id: str = "scheduler"
    nats: NatsConnection = NatsConnection()
    prefix_summary_interval_s: float = 0.5  # how often the cached blocks' summary goes to the tokenizers (placement)
    claim_expiry_s: float = 30.0  # a claimed rid whose GenerateRequest never arrives is forgotten
    kv_cache_memory_fraction: float | None = None  # CUDA: the KV caches' share of the memory free once weights (a drafter's too) are loaded; None: `resolved_kv_cache_memory_fraction`
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: any free port (logged)
    step_trace: str | None = None  # a directory: one JSON line per step to <instance_id>.jsonl (`step_trace.py`)
    tensor_parallel_size: int = 1  # ranks the model is sharded over (`rank_group.py`); 1: one process, no group

    def __post_init__(self) -> None:
        _check_choice("device", self.device, DEVICES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        _check_choice("speculative_algorithm", self.speculative_algorithm, SPECULATIVE_ALGORITHMS)
        if self.dtype is not None:
            _check_choice("dtype", self.dtype, (*DTYPES, "auto"))
        for name in ("chunked_prefill_size", "kv_block_size", "tensor_parallel_size"):
            _check_positive(name, getattr(self, name))
        if self.max_running_requests is not None:
            _check_positive("max_running_requests", self.max_running_requests)
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < self.chunked_prefill_size:
            raise ValueError(f"max_prefill_tokens ({self.max_prefill_tokens}) must be at least chunked_prefill_size "
                             f"({self.chunked_prefill_size})")  # fmt: skip
        for name in ("num_kv_blocks", "kv_cache_bytes", "max_model_len"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        _check_positive("claim_expiry_s", self.claim_expiry_s)
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1]; got {self.kv_cache_memory_fraction}")
        _check_choice("verify_mode", self.verify_mode, VERIFY_MODES)
        _check_choice("dense_attention", self.dense_attention, DENSE_ATTENTION_CHOICES)
        if self.num_draft_tokens is not None:
            _check_positive("num_draft_tokens", self.num_draft_tokens)
        if self.draft_context_window is not None and self.draft_context_window < 0:
            raise ValueError(f"draft_context_window must be >= 0 (0: the whole context); got {self.draft_context_window}")

    @property
    def resolved_max_prefill_tokens(self) -> int:
        return self.max_prefill_tokens or max(DEFAULT_MAX_PREFILL_TOKENS, self.chunked_prefill_size)

    @property
    def resolved_kv_cache_memory_fraction(self) -> float:
        if self.kv_cache_memory_fraction is not None:
            return self.kv_cache_memory_fraction
        return DRAFTER_KV_CACHE_FRACTION if self.speculative_algorithm == "dspark" else CUDA_KV_CACHE_FRACTION

    @property
    def resolved_draft_model(self) -> str:
        return self.draft_model if self.draft_model is not None else str(BUNDLED_DRAFT_MODEL)

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return checkpoint_dtype(self.model)
        if self.dtype is not None:
            return DTYPES[self.dtype]
        return torch.bfloat16 if self.resolved_device == "cuda" else torch.float32


def checkpoint_dtype(model_dir: str) -> torch.dtype:
    """`--dtype auto`: the dtype config.json names (`torch_dtype`, or `dtype` as transformers >= 5 writes it)."""
    from services.scheduler.model.config import ModelConfig

    name = ModelConfig.from_pretrained(model_dir).torch_dtype
    if name not in DTYPES:
        raise ValueError(f"--dtype auto: the checkpoint's dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive; got {value}")
