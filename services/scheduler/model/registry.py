"""Which network each supported `architectures` entry builds: the shared decoder (`llama.py`) or
a family module whose layer or checkpoint differs. `config.ARCHITECTURES` holds the same keys (what
each one's config sets); a test checks that the two tables agree."""

from __future__ import annotations

from services.scheduler.model.config import ModelConfig
from services.scheduler.model.gemma import GemmaForCausalLM
from services.scheduler.model.llama import CausalLM
from services.scheduler.model.moe import MixtralForCausalLM, MoeForCausalLM
from services.scheduler.model.phi3 import Phi3ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def build_model(config: ModelConfig) -> CausalLM:
    """The architecture's network with uninitialised weights (call under a device context to place them)."""
    return MODEL_CLASSES[config.architecture](config)
