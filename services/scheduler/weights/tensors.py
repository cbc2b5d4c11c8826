"""The tensors a swap replaces, checked against what arrived, and the swap itself.

The served tensors are the model's `checkpoint_tensors()` (Hugging Face names; fused parts as row
views), exactly what the loader fills at start-up, so a swap copies into the same storage: CUDA
graphs captured on the old weights read the new ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from contracts.weights import WeightTarget
from services.scheduler.model.loader import HARMLESS_SUFFIXES, QUANTIZED_DTYPES, _safetensors_files
from services.scheduler.worker import ModelWorker

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class WeightMismatch(ValueError):
    """New weights that do not fit the served model; names the first tensor at fault."""


def served_tensors(worker: ModelWorker, target: WeightTarget) -> dict[str, torch.Tensor]:
    """name -> the served tensor (a view into the model's parameters) of the target or drafter."""
    if getattr(worker.runner, "leader", None) is not None:  # rank 0 holds only its shards; the others would keep the old weights
        raise WeightMismatch("weight updates under --tensor-parallel-size > 1 are not supported yet: restart on the new weights")
    if target == WeightTarget.MODEL:
        return dict(worker.runner.model.checkpoint_tensors())
    drafter = getattr(dspark_proposer(worker), "drafter", None)
    if drafter is None:
        raise WeightMismatch("this scheduler runs no drafter: there are no draft weights to update")
    return dict(drafter.checkpoint_tensors())


def dspark_proposer(worker: ModelWorker):  # type: ignore[no-untyped-def]
    """The worker's DSpark proposer (under `DraftGraphs` on CUDA), or None."""
    proposer = worker.proposer
    return getattr(proposer, "proposer", proposer)


def check_shapes(served: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
    """`shapes`: name -> (shape, dtype name) of the new weights. Raises `WeightMismatch` at the
    first tensor (in the served order) missing, extra, of another shape or of a non-float dtype."""
    for name, tensor in served.items():
        if name not in shapes:
            raise WeightMismatch(f"tensor {name!r} is missing from the new weights")
        shape, dtype = shapes[name]
        if tuple(shape) != tuple(tensor.shape):
            raise WeightMismatch(f"tensor {name!r} has shape {list(shape)}, the served model's is {list(tensor.shape)}")
        if dtype in QUANTIZED_DTYPES or dtype not in {*map(_dtype_name, FLOAT_DTYPES), "F32", "F16", "BF16", "F64"}:
            raise WeightMismatch(f"tensor {name!r} is {dtype}: only float weights can replace float weights")
    extra = sorted(name for name in shapes if name not in served and not name.endswith(HARMLESS_SUFFIXES))
    if extra:
        raise WeightMismatch(f"tensor {extra[0]!r} is not one the served model consumes")


def read_safetensors(path: str | Path, served: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The new weights at `path` (a directory or one file) on the host, checked first by their
    headers alone (a mismatch costs no read)."""
    path = Path(path)
    files = [path] if path.is_file() else _safetensors_files(path)
    if not files:
        raise WeightMismatch(f"no *.safetensors files in {path}")
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                shapes[name] = (tuple(piece.get_shape()), piece.get_dtype())
    check_shapes(served, shapes)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys() if name in served}
    return tensors


@torch.no_grad()
def copy_weights(served: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> int:
    """Copy every new tensor into its served one, in place (between steps); the bytes copied."""
    copied = 0
    for name, tensor in served.items():
        tensor.copy_(tensors[name], non_blocking=False)
        copied += tensor.numel() * tensor.element_size()
    if any(t.is_cuda for t in served.values()):
        torch.cuda.synchronize()
    return copied


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
