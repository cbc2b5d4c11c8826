"""The composition root: a `SchedulerConfig` in, a served `SchedulerCore` out.

Every switch is resolved here, once, against the device it lands on (`CoreSettings`): the layers
below take the resolved values and never see a flag. `build_core` loads the model and the drafter,
prepares the runtime (CUDA graphs, the dense prefill kernel, the logprob kernels' compiles) and
assembles the core; `assemble_core` is the last step alone, for whoever brings a runner (tests,
benchmarks, the training evaluator), and `make_worker` / `make_policy` its two parts, for a
benchmark that brings a worker of its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.flags import (
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_MAX_RUNNING_REQUESTS,
    KV_TOKENS_PER_RUNNING_REQUEST,
    MAX_DEFAULT_RUNNING_REQUESTS,
)
from services.scheduler.model import MemoryReserve, ModelConfig, ModelRunner, load_model_runner
from services.scheduler.model.batch_invariant import set_batch_invariant
from services.scheduler.model.dense_attention import DenseConfig, resolve_dense_kernel
from services.scheduler.model.flash4_attention import warm_flash4
from services.scheduler.model.graphs import decode_ladder
from services.scheduler.model.ragged_graphs import seq_ladder, token_ladder
from services.scheduler.model.runner import triton_available
from services.scheduler.policy import Policy, PolicyConfig
from services.scheduler.spec.base import Proposer
from services.scheduler.spec.step_cost import DEFAULT_POINTS, StepCost
from services.scheduler.worker import ModelWorker, WorkerOptions

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class CoreSettings:
    """What the core, its policy and its worker are built with, every switch resolved."""

    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE
    max_prefill_tokens: int | None = None  # tokens per step while nothing decodes; None: chunked_prefill_size
    max_model_len: int | None = None  # None: the model's
    num_blocks: int | None = None  # use only this many of the runner's KV blocks (tests)
    verify_mode: str = "static"
    verify_step_cost: tuple[tuple[int, float], ...] = DEFAULT_POINTS  # `compact`: the drafter's SPS table
    seed: int = 0
    overlap_decode: bool = True  # the next step launched before this one's readback (`SchedulerCore`)
    prefix_caching: bool = True  # `BlockManager`: full KV blocks shared across requests
    worker: WorkerOptions = WorkerOptions()

    @classmethod
    def of(cls, **values) -> CoreSettings:
        """Settings from flat keywords, the worker's (`WorkerOptions`' fields) among them."""
        worker_fields = {f.name for f in dataclasses.fields(WorkerOptions)}
        worker = WorkerOptions(**{k: v for k, v in values.items() if k in worker_fields})
        return cls(**{k: v for k, v in values.items() if k not in worker_fields}, worker=worker)


def resolve(config: SchedulerConfig, runner: ModelRunner) -> CoreSettings:
    """The config's switches as they hold on the runner's device: a CUDA-only switch is off elsewhere."""
    on_cuda = runner.device.type == "cuda"
    # deterministic: the kernels split each row by the vocabulary alone (the worker passes runner.batch_invariant)
    fused_logprobs = config.fused_logprobs and on_cuda and triton_available()
    worker = WorkerOptions(
        logprobs_mode=config.logprobs_mode,
        logprob_graphs=config.logprob_cuda_graphs and on_cuda,
        greedy_logprob_graphs=config.greedy_logprob_graphs,
        fused_logprobs=fused_logprobs,
        tokenizer_dir=config.model,
    )
    return CoreSettings(
        max_running_requests=config.max_running_requests or default_max_running(runner, config.speculative_algorithm),
        chunked_prefill_size=config.chunked_prefill_size,
        max_prefill_tokens=config.resolved_max_prefill_tokens,
        max_model_len=config.max_model_len,
        verify_mode=config.verify_mode,
        verify_step_cost=StepCost.load(config.resolved_draft_model if config.speculative_algorithm == "dspark" else None).points,
        seed=config.seed,
        overlap_decode=config.overlap_decode,
        prefix_caching=config.prefix_caching,
        worker=worker,
    )


def default_max_running(runner: ModelRunner, speculative_algorithm: str = "none") -> int:
    """The running limit a GPU's KV cache affords (a small model on a large GPU scales past 64); 64
    off CUDA, and with a drafter (its verify graphs' logits buffers grow with rung x block width)."""
    if runner.device.type != "cuda" or speculative_algorithm != "none":
        return DEFAULT_MAX_RUNNING_REQUESTS
    per_kv = runner.num_blocks * runner.block_size // KV_TOKENS_PER_RUNNING_REQUEST // 64 * 64
    return max(DEFAULT_MAX_RUNNING_REQUESTS, min(MAX_DEFAULT_RUNNING_REQUESTS, per_kv))


def build_core(config: SchedulerConfig) -> SchedulerCore:
    """Load the model (minutes for a large one: call it off the event loop) and wrap it in a core.
    With `tensor_parallel_size` N > 1 this process is rank 0 of N (`rank_group.py`)."""
    if config.tensor_parallel_size > 1:
        runner = load_leader(config)
    else:
        runner = load_runner(config)
    proposer = load_proposer(config, runner)
    settings = resolve(config, runner)
    prepare_runtime(config, settings, runner, proposer)
    return assemble_core(runner, settings, proposer)


def assemble_core(
    runner: ModelRunner,
    settings: CoreSettings,
    proposer: Proposer | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SchedulerCore:
    return SchedulerCore(make_worker(runner, settings, proposer), make_policy(runner, settings, proposer),
                         overlap_decode=settings.overlap_decode, clock=clock)  # fmt: skip


def core_for(runner: ModelRunner, proposer: Proposer | None = None, clock: Callable[[], float] = time.monotonic,
             **settings) -> SchedulerCore:
    """`assemble_core` with settings as keywords (`CoreSettings.of`): tests, benchmarks, evaluation."""
    return assemble_core(runner, CoreSettings.of(**settings), proposer, clock)


def make_worker(runner: ModelRunner, settings: CoreSettings, proposer: Proposer | None = None) -> ModelWorker:
    return ModelWorker(runner, settings.worker, proposer)


def make_policy(runner: ModelRunner, settings: CoreSettings, proposer: Proposer | None = None) -> Policy:
    if settings.verify_mode == "compact" and proposer is not None and not proposer.has_confidence:
        raise ValueError("--verify-mode compact needs a drafter with a confidence head (enable_confidence_head)")
    model = runner.config
    num_blocks = runner.num_blocks if settings.num_blocks is None else min(settings.num_blocks, runner.num_blocks)
    return Policy(PolicyConfig(
        num_blocks=num_blocks,
        block_size=runner.block_size,
        max_running_requests=settings.max_running_requests,
        chunk_budget=settings.chunked_prefill_size,
        prefill_budget=settings.max_prefill_tokens,
        max_model_len=settings.max_model_len or model.max_position_embeddings,
        vocab_size=model.vocab_size,
        eos_ids=frozenset(model.eos_token_ids),
        num_draft_tokens=proposer.num_draft_tokens if proposer is not None else 0,
        verify_mode=settings.verify_mode,
        verify_step_cost=settings.verify_step_cost,
        seed=settings.seed,
        prefix_caching=settings.prefix_caching,
        cache_prompt_rows=settings.prefix_caching and settings.worker.logprobs_mode == "raw",
    ))  # fmt: skip


def check_model(config: SchedulerConfig) -> None:
    """What `build_core` refuses in milliseconds (no config.json, an unsupported architecture),
    raised before `connect`: a bad `--model` fails at once, whether NATS answers or not; so does a
    model `--tensor-parallel-size` cannot shard, before any rank is spawned."""
    from services.scheduler.model.tensor_parallel import check_shardable

    model = ModelConfig.from_pretrained(config.model, context_len=config.max_model_len)
    check_shardable(model, config.tensor_parallel_size)
    size = config.tensor_parallel_size
    if size > 1 and config.speculative_algorithm == "dspark":  # its drafter is sharded the same way
        from services.scheduler.spec.dspark_config import DSparkConfig

        check_shardable(DSparkConfig.from_pretrained(config.resolved_draft_model).backbone, size)
    if size > 1 and config.resolved_device == "cuda":
        import torch

        if torch.cuda.device_count() < size:
            raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs; {torch.cuda.device_count()} visible")


def load_leader(config: SchedulerConfig) -> ModelRunner:
    """Rank 0's runner: the followers spawned and joined, its shard loaded, its calls led."""
    from services.scheduler.rank_group import start_group, tensor_parallel

    groups, leader = start_group(config)
    model = ModelConfig.from_pretrained(config.model, context_len=config.max_model_len)
    runner = load_runner(config, tensor_parallel(groups, model, leader))
    runner.leader = leader
    return runner


def load_follower(config: SchedulerConfig, groups) -> tuple[ModelRunner, Proposer | None]:
    """Rank r > 0's runner and its shard of the drafter, loaded and prepared as rank 0's are (the same
    graphs capture the same collectives)."""
    from services.scheduler.rank_group import rank_device, tensor_parallel

    model = ModelConfig.from_pretrained(config.model, context_len=config.max_model_len)
    runner = load_runner(config, tensor_parallel(groups, model), rank_device(config.resolved_device, groups.rank))
    proposer = load_proposer(config, runner)
    prepare_runtime(config, resolve(config, runner), runner, proposer)
    return runner, proposer


def load_runner(config: SchedulerConfig, tp=None, device: str | None = None) -> ModelRunner:
    """tp: this rank's `TensorParallel` (None: the whole model); device: a rank's own (None: the config's)."""
    reserve = MemoryReserve()
    if config.speculative_algorithm == "dspark":
        from services.scheduler.spec.dspark_loader import drafter_memory

        target_config = ModelConfig.from_pretrained(config.model)
        max_rows = config.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS  # a drafter's, as `default_max_running` says
        reserve = drafter_memory(config.resolved_draft_model, target_config, config.torch_dtype, config.kv_block_size,
                                 config.tensor_parallel_size, max_rows)  # fmt: skip
    return load_model_runner(
        config.model,
        device=device or config.resolved_device,
        dtype=config.torch_dtype,
        load_format=config.load_format,
        num_kv_blocks=config.num_kv_blocks,
        kv_block_size=config.kv_block_size,
        kv_cache_bytes=config.kv_cache_bytes,
        kv_cache_fraction=config.resolved_kv_cache_memory_fraction,
        reserve=reserve,
        seed=config.seed,
        cuda_graphs=False,  # captured by `prepare_runtime`, once the verify width and captured layers are known
        # None: on where Triton runs (CUDA); deterministic needs its per-row norms
        fused_kernels=None if config.fused_kernels or config.deterministic else False,
        split_kv_decode=config.split_kv_decode,
        max_model_len=config.max_model_len,
        quantization=config.quantization,
        batch_invariant=config.deterministic,
        tp=tp,
    )


def load_proposer(config: SchedulerConfig, runner: ModelRunner) -> Proposer | None:
    if config.speculative_algorithm != "dspark":
        return None
    from services.scheduler.spec.dspark_loader import load_dspark_proposer

    proposer = load_dspark_proposer(  # a tensor-parallel rank's: its shard, run by every rank (`shard_drafter`)
        config.resolved_draft_model, runner, load_format=config.load_format, seed=config.seed,
        num_draft_tokens=config.num_draft_tokens, context_window=config.draft_context_window,
        confidences=config.verify_mode == "compact",
    )  # fmt: skip
    proposer.leader = runner.leader  # rank 0: each propose sent to the other ranks first
    set_batch_invariant(proposer.drafter, runner.batch_invariant)  # seeded drafts' q: the row's own
    if runner.decode_kernel:  # CUDA: greedy drafts replay graphs
        from services.scheduler.spec.draft_graphs import DraftGraphs

        proposer = DraftGraphs(proposer)
    return proposer


def prepare_runtime(config: SchedulerConfig, settings: CoreSettings, runner: ModelRunner, proposer: Proposer | None) -> None:
    """Everything a first request would otherwise wait for: graphs captured, kernels compiled. Out of
    device memory here is a start-up error naming the flag that leaves more (a `ValueError`: the
    scheduler says it in one line and exits)."""
    import torch

    try:
        _prepare_runtime(config, settings, runner, proposer)
    except torch.cuda.OutOfMemoryError as exc:
        raise ValueError(f"out of GPU memory at start-up, capturing graphs with the KV cache at "
                         f"{config.resolved_kv_cache_memory_fraction} of the memory free after the weights: pass a lower "
                         f"--kv-cache-memory-fraction or --max-running-requests ({str(exc).splitlines()[0]})") from exc  # fmt: skip


def _prepare_runtime(config: SchedulerConfig, settings: CoreSettings, runner: ModelRunner, proposer: Proposer | None) -> None:
    capture_layers = () if proposer is None else tuple(proposer.capture_layers)  # the drafter's context
    if runner.decode_kernel and not runner.batch_invariant:  # invariant: every step is ragged
        query_lens = (1,) if proposer is None else (1, proposer.num_draft_tokens + 1)
        runner.prepare_decode_graphs(decode_ladder(settings.max_running_requests), query_lens=query_lens,
                                     capture_layers=capture_layers)  # fmt: skip
    if config.ragged_cuda_graphs and runner.ragged_kernel:  # CUDA with Triton
        runner.prepare_ragged_graphs(seq_ladder(settings.max_running_requests), token_ladder(config.chunked_prefill_size),
                                     capture_layers=capture_layers)  # fmt: skip
        runner.ragged_graphs.capture_prefill_keys()  # arrivals beside decodes: no capture pauses them later
        if proposer is not None and settings.verify_mode == "compact":
            runner.ragged_graphs.capture_keys(runner.ragged_graphs.verify_keys(proposer.num_draft_tokens + 1), "verify")
    on_cuda = runner.device.type == "cuda"
    if config.dense_prefill and on_cuda and not runner.batch_invariant and config.resolved_max_prefill_tokens > config.chunked_prefill_size:
        # only queries no chunk-budget step holds: steps past the budget run eagerly whatever their path
        runner.dense_prefill = dense_prefill_config(config, runner)
    if settings.worker.fused_logprobs:
        warm_logprob_kernels(settings.worker, runner)


def warm_logprob_kernels(options: WorkerOptions, runner: ModelRunner) -> None:
    """Compile the fused logprob kernels for every top-k pad up to 20, so no step waits for a compile."""
    import torch

    from services.scheduler.triton_logprobs import warm_kernels

    start = time.perf_counter()
    greedy = options.logprob_graphs and options.greedy_logprob_graphs  # greedy steps' rows: f32, the argmax taken too
    warm_kernels(runner.config.vocab_size, runner.device, (torch.float32, runner.dtype),  # output rows f32, prompt rows the model's
                 (torch.float32,) if greedy else ())  # fmt: skip
    log.info("logprob_kernels.warmed", seconds=round(time.perf_counter() - start, 2))


def dense_prefill_config(config: SchedulerConfig, runner: ModelRunner) -> DenseConfig:
    """The dense path of steps past the chunk budget, on the kernel `--dense-attention` resolves to.
    FlashAttention-4 is compiled here, not inside the first long prompt's step; with auto, one that
    fails to (a package that imports but does not run here) leaves SDPA in its place, with a warning."""
    kernel = resolve_dense_kernel(config.dense_attention, runner.device)
    if kernel == "flash4":
        start = time.perf_counter()
        model = runner.config
        try:
            warm_flash4(runner.device, runner.dtype, model.num_attention_heads, model.num_key_value_heads, model.head_dim)
        except Exception as exc:
            if config.dense_attention == "flash4":
                raise
            log.warning("dense_attention.flash4_failed", error=f"{type(exc).__name__}: {exc}"[:500], kernel="sdpa")
            kernel = "sdpa"
        else:
            log.info("dense_attention.warmed", kernel=kernel, seconds=round(time.perf_counter() - start, 2))
    return DenseConfig(min_query_len=config.chunked_prefill_size + 1, kernel=kernel)
