"""The model's shape, parsed from a Hugging Face `config.json`.

Every supported architecture has a row in `ARCHITECTURES`: the options its config keys set on
`ModelConfig` (its module, `registry.MODEL_CLASSES`, builds the network). Both config dialects are
read: the classic `rope_theta` + `rope_scaling` keys that published checkpoints carry, and the
`rope_parameters` dict that transformers >= 5 writes (nested by layer type for Gemma 3).
Anything a config asks for that is not implemented is refused here, with one line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.scheduler.model.fp8 import SUPPORTED_QUANTIZATIONS, Fp8Scheme
from services.scheduler.model.rope import ROPE_TYPES, RopeScaling

FULL, SLIDING = "full_attention", "sliding_attention"
SUPPORTED_ROPE_TYPES = ROPE_TYPES
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

__all__ = ["ARCHITECTURES", "ModelConfig", "RopeScaling", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented here."""


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
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm over each head of q and k before RoPE
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    sparkwire_weights: str | None = None  # "seeded-random": no weight files, build from the seed
    sparkwire_seed: int = 0
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer; (): every layer FULL
    sliding_window: int | None = None  # keys a SLIDING layer's query sees, its own included
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    hidden_act: str = "silu"  # one of SUPPORTED_ACTIVATIONS (the MLP's gate)
    local_rope_theta: float | None = None  # Gemma 3: SLIDING layers' RoPE base (no scaling); None: rope_theta
    context_len: int | None = None  # the longest sequence served (--max-model-len); None: max_position_embeddings
    num_experts: int = 0  # mixture of experts (moe.py): experts of each sparse layer; 0: dense
    num_experts_per_tok: int = 0  # top-k experts a token is routed to
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = True  # the top-k router probabilities renormalized to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP (Qwen3-MoE's mlp_only_layers)
    quantization: Fp8Scheme | None = None  # fp8.py: FP8 weights (as shipped, or quantized at load)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(_unsupported_message(self.architecture))
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        self._check_layers()
        self._check_rope()
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, got {self.num_experts_per_tok}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}")

    def _check_layers(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if bad := sorted(set(self.layer_types) - {FULL, SLIDING}):
            raise UnsupportedModelError(f"layer_types {bad} are not supported; supported: {FULL}, {SLIDING}")
        if SLIDING in self.layer_types and not (self.sliding_window or 0) >= 1:
            raise ValueError(f"{SLIDING} layers need a positive sliding_window, got {self.sliding_window}")

    def _check_rope(self) -> None:
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "dynamic" and self.served_len > self.max_position_embeddings:
            raise UnsupportedModelError(
                f"rope_type 'dynamic' is served up to max_position_embeddings ({self.max_position_embeddings}), not "
                f"{self.served_len}: its base grows with each sequence's length, which cached keys cannot follow"
            )
        if scaling is not None and scaling.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(scaling, name)) != self.head_dim // 2:
                    raise ValueError(f"longrope {name} needs head_dim / 2 = {self.head_dim // 2} entries")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def served_len(self) -> int:
        return self.context_len or self.max_position_embeddings

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def layer_window(self, layer: int) -> int:
        """The keys layer `layer` attends to behind each query (its own included); 0: all of them."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == SLIDING else 0

    @property
    def has_windows_or_softcap(self) -> bool:
        return SLIDING in self.layer_types or self.attn_logit_softcap is not None

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None, context_len: int | None = None
    ) -> ModelConfig:
        architecture = _architecture(raw)
        quantization = _quantization(raw)
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope_theta, rope_scaling = _rope(raw, architecture)
        common = dict(
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
            attention_bias=False,
            o_proj_bias=False,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=False,
            eos_token_ids=_eos_token_ids(raw, generation or {}),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sparkwire_weights=raw.get("sparkwire_weights"),
            sparkwire_seed=int(raw.get("sparkwire_seed", 0)),
            hidden_act=str(raw.get("hidden_act") or "silu"),
            context_len=context_len,
            quantization=quantization,
        )
        return cls(**{**common, **ARCHITECTURES[architecture](raw)})

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, context_len: int | None = None) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` when present) from a model directory."""
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        raw = json.loads(config_path.read_text(encoding="utf-8"))
        generation_path = model_dir / "generation_config.json"
        generation = json.loads(generation_path.read_text(encoding="utf-8")) if generation_path.is_file() else {}
        return cls.from_dict(raw, generation, context_len)


# ---- each architecture's options ----


def _llama(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias}


def _every_layer_sliding(raw: dict[str, Any]) -> dict[str, Any]:
    """Mistral, Phi-3: `sliding_window` (when set) on every layer, as transformers masks them."""
    window = raw.get("sliding_window")
    layers = int(raw["num_hidden_layers"])
    return {"sliding_window": int(window), "layer_types": (SLIDING,) * layers} if window else {}


def _qwen_windows(raw: dict[str, Any]) -> dict[str, Any]:
    """`use_sliding_window`: layers from `max_window_layers` on slide (transformers' rule), unless the
    config lists its `layer_types`."""
    if not raw.get("use_sliding_window"):
        return {}
    layers = int(raw["num_hidden_layers"])
    first = int(raw.get("max_window_layers", layers))
    default = tuple(SLIDING if i >= first else FULL for i in range(layers))
    return {"sliding_window": int(raw["sliding_window"]), "layer_types": tuple(raw.get("layer_types") or default)}


def _qwen2(raw: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True, **_qwen_windows(raw)}


def _qwen3(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias, "qk_norm": True, **_qwen_windows(raw)}


def _gemma(raw: dict[str, Any], pattern: int, qk_norm: bool) -> dict[str, Any]:
    """Gemma 2 and 3: every `pattern`-th layer global, the others sliding (unless `layer_types`
    says), scores scaled by query_pre_attn_scalar ** -0.5, GeGLU (tanh GELU) MLPs."""
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention (Gemma's encoder mode) is not supported")
    layers = int(raw["num_hidden_layers"])
    default = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))
    return {
        "qk_norm": qk_norm,
        "attention_bias": bool(raw.get("attention_bias", False)),
        "o_proj_bias": bool(raw.get("attention_bias", False)),
        "layer_types": tuple(raw.get("layer_types") or default),
        "sliding_window": int(raw["sliding_window"]) if raw.get("sliding_window") else None,
        "attention_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_logit_softcap": _optional_float(raw.get("attn_logit_softcapping")),
        "final_logit_softcap": _optional_float(raw.get("final_logit_softcapping")),
        "hidden_act": str(raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
    }


def _gemma2(raw: dict[str, Any]) -> dict[str, Any]:
    return _gemma(raw, pattern=2, qk_norm=False)


def _gemma3(raw: dict[str, Any]) -> dict[str, Any]:
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    return {**_gemma(raw, pattern, qk_norm=True), "local_rope_theta": _gemma3_local_theta(raw)}


def _qwen3_moe(raw: dict[str, Any]) -> dict[str, Any]:
    """Sparse layers: every `decoder_sparse_step`-th one not in `mlp_only_layers` (transformers' rule)."""
    layers, step = int(raw["num_hidden_layers"]), int(raw.get("decoder_sparse_step") or 1)
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    only_mlp = {int(i) for i in raw.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(layers) if i in only_mlp or experts == 0 or (i + 1) % step)
    return {**_qwen3(raw), **_experts(raw, experts, int(raw["moe_intermediate_size"])),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)), "dense_layers": dense}  # fmt: skip


def _mixtral(raw: dict[str, Any]) -> dict[str, Any]:
    experts = _experts(raw, int(raw["num_local_experts"]), int(raw["intermediate_size"]))
    return {**_llama(raw), **_every_layer_sliding(raw), **experts, "norm_topk_prob": True}


def _experts(raw: dict[str, Any], experts: int, intermediate: int) -> dict[str, Any]:
    return {"num_experts": experts, "num_experts_per_tok": int(raw["num_experts_per_tok"]), "moe_intermediate_size": intermediate}


# architecture -> the ModelConfig options its config sets (on top of the shapes every config has)
ARCHITECTURES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": lambda raw: {**_llama(raw), **_every_layer_sliding(raw)},
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Phi3ForCausalLM": _every_layer_sliding,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "MixtralForCausalLM": _mixtral,
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


# ---- shared parsing ----


def _unsupported_message(architecture: str) -> str:
    return f"unsupported model architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if not architectures:
        raise UnsupportedModelError(_unsupported_message("<none: config.json has no 'architectures'>"))
    if architectures[0] not in ARCHITECTURES:
        raise UnsupportedModelError(_unsupported_message(architectures[0]))
    return architectures[0]


def _quantization(raw: dict[str, Any]) -> Fp8Scheme | None:
    """The checkpoint's quantization_config as loaded (fp8); any other quant_method is refused in one line."""
    quantization = raw.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method", "<no quant_method>") if isinstance(quantization, dict) else quantization
    if method not in SUPPORTED_QUANTIZATIONS:
        raise UnsupportedModelError(
            f"quantization_config quant_method {method!r} is not supported (supported: {', '.join(SUPPORTED_QUANTIZATIONS)}, "
            "or an unquantized checkpoint)"
        )
    return _fp8_scheme(quantization)


def _fp8_scheme(quantization: dict[str, Any]) -> Fp8Scheme:
    if (quantization.get("activation_scheme") or "dynamic") != "dynamic":
        raise UnsupportedModelError(f"fp8 activation_scheme {quantization['activation_scheme']!r} is not supported (dynamic only)")
    if str(quantization.get("fmt") or "e4m3") != "e4m3":
        raise UnsupportedModelError(f"fp8 fmt {quantization['fmt']!r} is not supported (e4m3 only)")
    block = quantization.get("weight_block_size")
    skipped = tuple(quantization.get("modules_to_not_convert") or quantization.get("ignored_layers") or ())
    return Fp8Scheme(block=(int(block[0]), int(block[1])) if block else None, skipped=skipped)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _rope(raw: dict[str, Any], architecture: str) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters") or {}
    if FULL in params:  # nested by layer type (Gemma 3, transformers >= 5): the global layers' rope
        params = params[FULL] or {}
    scaling = raw.get("rope_scaling") or params
    default_theta = 1_000_000.0 if architecture == "Gemma3ForCausalLM" else 10000.0
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or default_theta)
    if float(scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 (RoPE on part of each head) is not supported")
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if architecture == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's earlier names for it, as transformers reads them
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    return theta, None if rope_type == "default" else _rope_scaling(rope_type, scaling, raw)


def _rope_scaling(rope_type: str, scaling: dict[str, Any], raw: dict[str, Any]) -> RopeScaling:
    if rope_type in ("linear", "dynamic", "llama3") and scaling.get("factor") is None:
        raise ValueError(f"rope_scaling {rope_type!r} needs a factor")
    # Phi-3 keeps its pretraining length at the top level, which transformers prefers.
    original = raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    return RopeScaling(
        rope_type=rope_type,
        factor=_optional_float(scaling.get("factor")),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original or raw.get("max_position_embeddings", 32768)),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=_optional_float(scaling.get("mscale")),
        mscale_all_dim=_optional_float(scaling.get("mscale_all_dim")),
        truncate=bool(scaling.get("truncate", True)),
        attention_factor=_optional_float(scaling.get("attention_factor")),
        short_factor=tuple(float(f) for f in scaling.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in scaling.get("long_factor") or ()),
    )


def _gemma3_local_theta(raw: dict[str, Any]) -> float:
    local = (raw.get("rope_parameters") or {}).get(SLIDING) or {}
    if (local.get("rope_type") or "default") != "default":
        raise UnsupportedModelError(f"Gemma 3 sliding layers with rope_type {local['rope_type']!r} are not supported")
    return float(raw.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0)


def _eos_token_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for value in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)
