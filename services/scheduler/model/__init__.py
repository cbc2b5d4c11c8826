"""Model runtime: config parsing, the Llama/Qwen2/Qwen3 decoder, paged KV cache, loader, runner."""

from services.scheduler.model.batch import ForwardBatch, ForwardOutput
from services.scheduler.model.config import ModelConfig, UnsupportedModelError
from services.scheduler.model.loader import MemoryReserve, MissingTensorError, NoWeightsError, load_model_runner
from services.scheduler.model.runner import ModelRunner

__all__ = [
    "ForwardBatch",
    "ForwardOutput",
    "MemoryReserve",
    "MissingTensorError",
    "ModelConfig",
    "ModelRunner",
    "NoWeightsError",
    "UnsupportedModelError",
    "load_model_runner",
]
