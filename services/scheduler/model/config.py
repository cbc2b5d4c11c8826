"""The model's shape, parsed from a Hugging Face `config.json` (Llama, Qwen2 and Qwen3 families).

Both config dialects are read: the classic `rope_theta` + `rope_scaling` keys that published
checkpoints carry, and the `rope_parameters` dict that transformers >= 5 writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented here."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling; `rope_type` "default" means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # Llama puts attention_bias on o_proj too; Qwen2 does not
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    sparkwire_weights: str | None = None  # "seeded-random": no weight files, build from the seed
    sparkwire_seed: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(_unsupported_message(self.architecture))
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        architecture = _architecture(raw)
        if raw.get("use_sliding_window"):
            raise UnsupportedModelError(f"{architecture} with use_sliding_window=true is not supported")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        llama_bias = bool(raw.get("attention_bias", False))
        rope_theta, rope_scaling = _rope(raw)
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            attention_bias=True if is_qwen2 else llama_bias,
            o_proj_bias=False if is_qwen2 else llama_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            eos_token_ids=_eos_token_ids(raw, generation or {}),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sparkwire_weights=raw.get("sparkwire_weights"),
            sparkwire_seed=int(raw.get("sparkwire_seed", 0)),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` when present) from a model directory."""
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        raw = json.loads(config_path.read_text(encoding="utf-8"))
        generation_path = model_dir / "generation_config.json"
        generation = json.loads(generation_path.read_text(encoding="utf-8")) if generation_path.is_file() else {}
        return cls.from_dict(raw, generation)


def _unsupported_message(architecture: str) -> str:
    return f"unsupported model architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if not architectures:
        raise UnsupportedModelError(_unsupported_message("<none: config.json has no 'architectures'>"))
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(_unsupported_message(architectures[0]))
    return architectures[0]


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _eos_token_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for value in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)
