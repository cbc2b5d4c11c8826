"""Build a `ModelRunner` from a model directory: real safetensors weights or seeded random ones.

load_format "auto" reads `*.safetensors` (one file, or shards listed in
`model.safetensors.index.json`); a directory without weights whose config says
`"sparkwire_weights": "seeded-random"` (the random test model, sparkwire-tiny) gets weights from its
`sparkwire_seed`. load_format "dummy" always builds random weights from config.json alone.
Either way every tensor filled counts on one `Progress` (a bar on a terminal, else log records).

Loading is strict: before any tensor is read, every name in the checkpoint must be one the model
consumes (`checkpoint_tensors`) or known to be harmless (`HARMLESS_SUFFIXES`, a tied model's copy of
its embedding as `lm_head.weight`), and of a float dtype: an extra bias, a quantization scale or an
integer/float8 weight is an error naming it, never dropped or cast in silence.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from services.common.progress import Progress
from services.scheduler.flags import CUDA_KV_CACHE_FRACTION, DEFAULT_SPLIT_KV_DECODE, LOAD_FORMATS, QUANTIZATIONS
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.fp8 import FP8, empty_fp8_linears, quantize_linears
from services.scheduler.model.kv_cache import PagedKVCache, bytes_per_block, num_blocks_for_budget
from services.scheduler.model.llama import CausalLM
from services.scheduler.model.moe import empty_fp8_experts, quantize_experts
from services.scheduler.model.registry import build_model
from services.scheduler.model.runner import ModelRunner
from services.scheduler.model.tensor_parallel import (
    ShardedRows,
    TensorParallel,
    check_shardable,
    shard_config,
    shard_model,
)

DUMMY_STD = 0.02  # the reference initializer_range
# Random tensors larger than this repeat with this period: generating billions of values on the
# host would dominate start-up of a dummy 8B model, and benchmarks only need plausible numbers.
DUMMY_PERIOD = 4_000_037
CPU_KV_CACHE_CAP_BYTES = 1 << 30
# Checkpoint tensors no model consumes and none needs: RoPE tables some exports keep (recomputed here).
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors dtypes of quantized weights: loaded into float parameters they would be wrong.
QUANTIZED_DTYPES = ("F8_E4M3", "F8_E5M2", "I8", "U8", "I4", "U4")


class MissingTensorError(KeyError):
    """A parameter the model needs is absent from the checkpoint's safetensors files."""

    def __init__(self, name: str, model_dir: Path) -> None:
        super().__init__(f"tensor {name!r} not found in the safetensors files of {model_dir}")
        self.name = name
        self.model_dir = model_dir

    def __str__(self) -> str:
        return str(self.args[0])


class UnexpectedTensorError(KeyError):
    """A checkpoint tensor the model does not consume, or one whose dtype it cannot take as it is."""

    def __str__(self) -> str:
        return str(self.args[0])


class NoWeightsError(FileNotFoundError):
    """load_format "auto" found neither safetensors nor a seeded-random marker."""


log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class MemoryReserve:
    """Device memory the KV cache budget must leave to others: a drafter's weights (loaded after
    the target, once its embedding and LM head exist), the vocabulary-wide tensors its steps hold
    (`dspark_loader.draft_step_bytes`), and its own KV cache, which has as many blocks as the target's."""

    weight_bytes: int = 0  # taken from the free memory before the cache is sized (CUDA)
    bytes_per_block: int = 0  # each cache block costs this much more elsewhere
    step_bytes: int = 0  # taken like the weights: what a step holds at the most running requests


def load_model_runner(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    num_kv_blocks: int | None = None,
    kv_block_size: int = 16,
    kv_cache_bytes: int | None = None,
    seed: int = 0,
    cuda_graphs: bool | None = None,
    kv_cache_fraction: float = CUDA_KV_CACHE_FRACTION,
    reserve: MemoryReserve = MemoryReserve(),
    fused_kernels: bool | None = None,
    split_kv_decode: bool = DEFAULT_SPLIT_KV_DECODE,
    max_model_len: int | None = None,
    quantization: str | None = None,
    batch_invariant: bool = False,
    tp: TensorParallel | None = None,
) -> ModelRunner:
    """Load the model at `path` onto `device` in `dtype` and allocate its paged KV cache.

    cuda_graphs None: capture decode CUDA graphs when on CUDA with Triton; True/False forces it.
    fused_kernels: `ModelRunner.fused_kernels` (None: on CUDA with Triton). split_kv_decode:
    `ModelRunner.split_kv_decode` (default on). batch_invariant: `ModelRunner.batch_invariant`
    (`--deterministic`; no decode graphs: every step is ragged).
    kv_cache_bytes (or, on CUDA, `kv_cache_fraction` of the memory free after the weights and the
    reserve's weights) holds the cache's blocks together with the reserve's per-block bytes.
    max_model_len: the longest sequence served (`ModelConfig.context_len`: LongRoPE's factors, and
    dynamic RoPE's limit); None: the config's max_position_embeddings.
    quantization "fp8": quantize an unquantized checkpoint's projections and expert stacks to FP8 at load (`fp8.py`, `moe.py`).
    tp: this rank's shard of a tensor-parallel group (`tensor_parallel.py`): its weights sliced as they are read.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    model_dir = Path(path)
    config = ModelConfig.from_pretrained(model_dir, context_len=max_model_len)
    if batch_invariant and (config.num_experts or config.quantization is not None or quantization is not None):
        raise ValueError("--deterministic covers dense bf16/fp32 models only: MoE experts and FP8 projections are not batch-invariant yet")
    if batch_invariant and tp is not None:
        raise ValueError("--deterministic with --tensor-parallel-size > 1 is not supported yet: the shards' all-reduces are not batch-invariant")
    device = torch.device(device)
    if tp is not None:
        check_shardable(config, tp.size)
    model = _empty_model(config, device, dtype, tp)
    _fill_weights(model, model_dir, config, load_format, seed, tp)
    if quantization is not None:
        model = _quantize_at_load(model, config, quantization, tp)
    model.eval()
    config = model.config  # a rank's own head counts: its cache holds its KV heads
    num_blocks = num_kv_blocks or _default_num_blocks(config, kv_block_size, dtype, device, kv_cache_bytes, kv_cache_fraction, reserve)
    if tp is not None:  # every rank's cache holds the blocks rank 0's policy hands out
        num_blocks = tp.min_over_ranks(num_blocks, device)
    cache = PagedKVCache(config, num_blocks, kv_block_size, dtype, device)
    log.info("kv_cache.allocated", blocks=num_blocks, tokens=num_blocks * kv_block_size, gib=round(cache.kv.nbytes / 2**30, 2),
             free_gib=round(torch.cuda.mem_get_info(device)[0] / 2**30, 2) if device.type == "cuda" else None)  # fmt: skip
    runner = ModelRunner(model, cache, fused_kernels=fused_kernels, split_kv_decode=split_kv_decode,
                         batch_invariant=batch_invariant)  # fmt: skip
    if tp is not None:
        runner.sharded_rows = ShardedRows(runner)
    if (cuda_graphs if cuda_graphs is not None else runner.decode_kernel) and not batch_invariant:
        runner.prepare_decode_graphs()
    return runner


def _empty_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel | None = None) -> CausalLM:
    # Built on the meta device so no host memory or init kernels are spent on weights we overwrite.
    with torch.device("meta"):
        if tp is None:
            model = build_model(config).to(dtype)
        else:
            model = shard_model(build_model(shard_config(config, tp.size)).to(dtype), tp)
        if config.quantization is not None:  # after the cast: FP8 weights and fp32 scales keep their dtypes
            model = empty_fp8_experts(empty_fp8_linears(model, config.quantization), config.quantization)
    model = model.to_empty(device=device)
    model.init_rope(device)  # fp32: positions need the precision
    return model


def _quantize_at_load(model: CausalLM, config: ModelConfig, quantization: str, tp: TensorParallel | None) -> CausalLM:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    if config.quantization is not None:
        raise ValueError("--quantization fp8 quantizes an unquantized checkpoint; this one is already fp8")
    if tp is not None and config.num_experts:
        raise ValueError("--quantization fp8 with --tensor-parallel-size > 1 quantizes dense models only: MoE experts are not sharded in FP8 yet")
    return quantize_experts(quantize_linears(model, None if tp is None else tp.whole_amax))


def _fill_weights(
    model: CausalLM, model_dir: Path, config: ModelConfig, load_format: str, seed: int, tp: TensorParallel | None = None
) -> None:
    if load_format == "dummy":
        fill_random_weights(model, seed, tp)
    elif _safetensors_files(model_dir):
        load_safetensors(model, model_dir, tp=tp)
    elif config.sparkwire_weights == "seeded-random":
        fill_random_weights(model, config.sparkwire_seed, tp)
    else:
        raise NoWeightsError(
            f"no *.safetensors files in {model_dir}; pass --load-format dummy for random weights"
        )


def _safetensors_files(model_dir: Path) -> list[Path]:
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        return sorted({model_dir / name for name in weight_map.values()})
    return sorted(model_dir.glob("*.safetensors"))


@torch.no_grad()
def load_safetensors(
    model: torch.nn.Module, model_dir: Path, ignored: tuple[str, ...] = (), tp: TensorParallel | None = None
) -> None:
    """Copy every parameter, by its Hugging Face name, from the directory's safetensors files, after
    checking the files' names against the model's (`ignored`: names the caller knows it does not use;
    `tp`: each tensor sliced to this rank's part)."""
    needed = dict(model.checkpoint_tensors())
    files = _safetensors_files(model_dir)
    fp8_names = {name for name, param in needed.items() if param.dtype == FP8}
    check_checkpoint_names(model, model_dir, files, set(needed), set(ignored) | _tied_head(model), fp8_names)
    progress = _load_progress(model, needed.values(), path=str(model_dir))
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if name in needed:
                    param = needed.pop(name)
                    tensor = handle.get_tensor(name)
                    param.copy_(_fitted(tensor if tp is None else tp.shard(name, tensor), param))
                    progress.advance(num_bytes=_nbytes(param), tensor=name)
    progress.close()


def _fitted(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A per-row scale shipped as [N, 1] for a parameter [N]; a per-tensor one ([] or [1]) broadcasts."""
    return tensor.view(param.shape) if tensor.shape != param.shape and tensor.numel() == param.numel() else tensor


def check_checkpoint_names(
    model: torch.nn.Module, model_dir: Path, files: list[Path], needed: set[str], ignored: set[str],
    fp8_names: set[str] = frozenset(),
) -> None:
    """Raise unless the files hold exactly the needed tensors (plus ignored or harmless ones), each
    of a float dtype (float8 e4m3 where the parameter is, `fp8_names`): a missing one is
    `MissingTensorError`, an extra or quantized one `UnexpectedTensorError`."""
    found: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                found.add(name)
                _check_tensor(model, path, name, handle.get_slice(name).get_dtype(), needed, ignored, fp8_names)
    if missing := needed - found:
        raise MissingTensorError(sorted(missing)[0], model_dir)


def _check_tensor(
    model: torch.nn.Module, path: Path, name: str, dtype: str, needed: set[str], ignored: set[str], fp8_names: set[str]
) -> None:
    where = f"checkpoint tensor {name!r} ({path.name})"
    if name not in needed and name not in ignored and not name.endswith(HARMLESS_SUFFIXES):
        raise UnexpectedTensorError(f"{where} is not consumed by {type(model).__name__}: refused rather than dropped")
    if name in needed and dtype in QUANTIZED_DTYPES and not (dtype == "F8_E4M3" and name in fp8_names):
        raise UnexpectedTensorError(f"{where} is {dtype}: quantized weights are not supported")


def _tied_head(model: torch.nn.Module) -> set[str]:
    """A tied model's `lm_head.weight`, which some checkpoints keep as a copy of the embedding:
    transformers ties it back to the embedding and ignores it too."""
    config = getattr(model, "config", None)
    return {"lm_head.weight"} if isinstance(config, ModelConfig) and config.tie_word_embeddings else set()


@torch.no_grad()
def fill_random_weights(model: CausalLM, seed: int, tp: TensorParallel | None = None, shapes: dict[str, torch.Size] | None = None) -> None:
    """Deterministic weights: same seed, same values, on any device (drawn on the host, then moved);
    with `tp`, this rank's slices of the whole model's tensors (`shapes`: theirs; None: tp.config's CausalLM's)."""
    tensors = list(model.checkpoint_tensors())
    if tp is not None and shapes is None:
        shapes = _whole_shapes(tp.config)
    progress = _load_progress(model, [param for _, param in tensors], weights="random")
    for name, param in tensors:
        if name.endswith(("norm.weight", "weight_scale", "weight_scale_inv")):  # scales of 1: FP8 weights as drawn
            param.fill_(1.0)
        elif shapes is None:
            param.copy_(_random_tensor(name, param.shape, seed, param.device))
        else:
            param.copy_(tp.shard(name, _random_tensor(name, shapes[name], seed, torch.device("cpu"))))
        progress.advance(num_bytes=_nbytes(param), tensor=name)
    progress.close()


@torch.no_grad()
def _whole_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {name: param.shape for name, param in build_model(config).checkpoint_tensors()}


def _load_progress(model: torch.nn.Module, params, **fields: str) -> Progress:
    params = list(params)
    total = sum(_nbytes(param) for param in params)
    return Progress("model.load", "tensors", len(params), total_bytes=total, model=type(model).__name__, **fields)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _random_tensor(name: str, shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    # Each tensor has its own stream, so values do not depend on parameter order.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    numel = shape.numel()
    period = torch.empty(min(numel, DUMMY_PERIOD)).normal_(0.0, DUMMY_STD, generator=generator).to(device)
    if numel <= DUMMY_PERIOD:
        return period.view(shape)
    return period.repeat(-(-numel // DUMMY_PERIOD))[:numel].view(shape)


def _default_num_blocks(
    config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device, budget: int | None,
    fraction: float = CUDA_KV_CACHE_FRACTION, reserve: MemoryReserve = MemoryReserve(),
) -> int:
    if budget is None and device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        budget = cuda_kv_budget(free_bytes, fraction, reserve)
    if budget is None:
        # Room for two full-length sequences, within a cap that keeps CPU runs light.
        block_bytes = bytes_per_block(config, block_size, dtype) + reserve.bytes_per_block
        budget = min(2 * config.max_position_embeddings // block_size * block_bytes, CPU_KV_CACHE_CAP_BYTES)
    # One block of the budget is the cache's trash block (padded CUDA-graph rows write there).
    return max(1, num_blocks_for_budget(config, block_size, dtype, budget, reserve.bytes_per_block) - 1)


def cuda_kv_budget(free_bytes: int, fraction: float, reserve: MemoryReserve) -> int:
    """Bytes for the KV caches: `fraction` of what stays free once the reserve's weights load and
    its steps' tensors are set aside."""
    return int(max(0, free_bytes - reserve.weight_bytes - reserve.step_bytes) * fraction)
