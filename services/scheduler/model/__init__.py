"""Model runtime: config parsing, the decoder families (`registry.py`), paged KV cache, loader, runner."""

from services.scheduler.model.batch import ForwardBatch, ForwardOutput
from services.scheduler.model.config import ModelConfig, UnsupportedModelError
from services.scheduler.model.loader import (
    MemoryReserve,
    MissingTensorError,
    NoWeightsError,
    UnexpectedTensorError,
    load_model_runner,
)
from services.scheduler.model.runner import ModelRunner

__all__ = [
    "ForwardBatch",
    "ForwardOutput",
    "MemoryReserve",
    "MissingTensorError",
    "ModelConfig",
    "ModelRunner",
    "NoWeightsError",
    "UnexpectedTensorError",
    "UnsupportedModelError",
    "load_model_runner",
]
