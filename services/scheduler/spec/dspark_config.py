"""A DSpark draft model's config.json, in the DeepSpec Qwen3 DSpark layout.

The file is a Qwen3 config (the draft layers' shapes: `hidden_size`, `num_hidden_layers` = draft
layers, heads, `head_dim`, `intermediate_size`, `rope_theta`, ...) with
`architectures: ["Qwen3DSparkModel"]` and the DSpark fields:

- `block_size`: how many tokens one block drafts. DeepSpec's block is `block_size` slots,
  [anchor, mask x (block_size - 1)], and slot k predicts the token at anchor + k + 1 (the anchor's
  own slot predicts first; SGLang's loader says the same: "DeepSpec trains block slot k to predict
  anchor+k+1 with every slot trained"). So gamma = block_size: the published Qwen3 drafts have
  block_size 7, i.e. 7 drafts and a verify width of 8. (Plain DFlash differs: its block of 16
  holds the anchor plus 15 predicting mask slots.)
- `mask_token_id`: the token embedded at the mask slots; must be < the target's vocabulary.
- `target_layer_ids`: the K target decoder layers whose outputs form the context (layer i = the
  output of decoder layer i, 0-based; -1, as DeepSpec allows, the embedding output: the stream
  layer 0 reads, i.e. Hugging Face's `hidden_states[i + 1]` for every i). `num_target_layers`: the
  target's layer count, checked against it.
- `num_anchors`: anchors sampled per training sequence (training only).
- `markov_rank` r (0: no Markov head), `markov_head_type`: "vanilla" (W2 W1[prev], the paper's
  default), "gated" or "rnn" (its variants; see dspark_model).
- `enable_confidence_head`, `confidence_head_with_markov` (the head also sees W1[prev]).
- `sparkwire_context_window` (this project's, optional): how many context positions before its
  anchor a block attends to when serving; a drafter trained on sequences of S tokens never saw an
  anchor further than S positions from its context's start, and past that its accept length falls.
  Absent: the whole context, as published drafts.

Also read: `target_layer_ids` / `mask_token_id` nested in a `dflash_config` dict (SpecForge's layout).
Refused: `speculators_model_type` (the speculators convention, slot j predicting anchor + j, would
load and silently draft one position off; SGLang refuses it too) and non-full-attention `layer_types`.

"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.scheduler.model.config import ModelConfig, UnsupportedModelError

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
DEFAULT_NUM_ANCHORS = 512  # the paper's anchors per training sequence
EMBEDDING_LAYER = -1  # a target_layer_ids entry: the embedding output (DeepSpec's convention)
_NESTED_KEYS = ("target_layer_ids", "mask_token_id")
# Qwen3 shape keys a draft config.json carries (besides the DSpark fields).
_SHAPE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
    "attention_bias",
)  # fmt: skip


class DraftConfigError(ValueError):
    """A draft config.json is malformed, or does not fit the target model it is paired with."""


@dataclass(frozen=True)
class DSparkConfig:
    backbone: ModelConfig  # the draft layers' Qwen3 shapes (architecture read as Qwen3ForCausalLM)
    block_size: int  # gamma: draft tokens per block (see the module docstring)
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    num_anchors: int = DEFAULT_NUM_ANCHORS
    context_window: int | None = None  # context positions a block sees before its anchor; None: all

    def __post_init__(self) -> None:
        _check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _check(0 <= self.mask_token_id < self.vocab_size,
               f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")  # fmt: skip
        _check_layer_ids(self.target_layer_ids, self.num_target_layers)
        _check(self.markov_rank >= 0, f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_rank > 0 and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise UnsupportedModelError(
                f"markov_head_type {self.markov_head_type!r} is not supported; supported: {MARKOV_HEAD_TYPES}"
            )
        _check(not (self.confidence_head_with_markov and self.enable_confidence_head and self.markov_rank == 0),
               "confidence_head_with_markov needs a Markov head (markov_rank > 0)")  # fmt: skip
        _check(self.num_anchors >= 1, f"num_anchors must be >= 1, got {self.num_anchors}")
        _check(self.context_window is None or self.context_window >= 1,
               f"sparkwire_context_window must be >= 1, got {self.context_window}")  # fmt: skip

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.backbone.vocab_size

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def confidence_uses_markov(self) -> bool:
        return self.enable_confidence_head and self.confidence_head_with_markov

    def check_target(self, target: ModelConfig) -> None:
        """Raise DraftConfigError unless this draft fits `target` (shared embedding, LM head, layers)."""
        _check(self.num_target_layers == target.num_hidden_layers,
               f"draft num_target_layers ({self.num_target_layers}) != the target's num_hidden_layers "
               f"({target.num_hidden_layers})")  # fmt: skip
        _check_layer_ids(self.target_layer_ids, target.num_hidden_layers)
        _check(self.hidden_size == target.hidden_size,
               f"draft hidden_size ({self.hidden_size}) != target hidden_size ({target.hidden_size}): the "
               "drafter uses the target's embedding and LM head")  # fmt: skip
        _check(self.mask_token_id < target.vocab_size,
               f"mask_token_id {self.mask_token_id} >= the target's vocab_size {target.vocab_size}")
        _check(self.vocab_size == target.vocab_size,
               f"draft vocab_size ({self.vocab_size}) != target vocab_size ({target.vocab_size})")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DSparkConfig:
        architectures = raw.get("architectures") or []
        _check(architectures[:1] == [DSPARK_ARCHITECTURE],
               f"draft config architectures must be [{DSPARK_ARCHITECTURE!r}], got {architectures}")
        _refuse_other_conventions(raw)
        # SpecForge-trained drafts keep these two in a nested `dflash_config`.
        raw = {**{k: v for k, v in (raw.get("dflash_config") or {}).items() if k in _NESTED_KEYS}, **raw}
        for key in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers"):
            _check(key in raw, f"draft config.json lacks {key!r}")
        markov_rank = int(raw.get("markov_rank", 0))
        enable_confidence = bool(raw.get("enable_confidence_head", False))
        return cls(
            backbone=ModelConfig.from_dict({**raw, "architectures": ["Qwen3ForCausalLM"]}),
            block_size=int(raw["block_size"]),
            mask_token_id=int(raw["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in raw["target_layer_ids"]),
            num_target_layers=int(raw["num_target_layers"]),
            markov_rank=markov_rank,
            markov_head_type=str(raw.get("markov_head_type", "vanilla")).lower(),
            enable_confidence_head=enable_confidence,
            confidence_head_with_markov=enable_confidence and bool(raw.get("confidence_head_with_markov", False)),
            num_anchors=int(raw.get("num_anchors", DEFAULT_NUM_ANCHORS)),
            context_window=None if raw.get("sparkwire_context_window") is None else int(raw["sparkwire_context_window"]),
        )

    @classmethod
    def from_pretrained(cls, draft_dir: str | Path) -> DSparkConfig:
        config_path = Path(draft_dir) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in draft model directory {draft_dir}")
        return cls.from_dict(json.loads(config_path.read_text(encoding="utf-8")))

    def to_dict(self) -> dict[str, Any]:
        """The config.json a checkpoint saved by this project carries (DeepSpec layout)."""
        shapes = {key: getattr(self.backbone, key) for key in _SHAPE_KEYS}
        rope_scaling = self.backbone.rope_scaling
        return {
            "architectures": [DSPARK_ARCHITECTURE],
            "model_type": "qwen3",
            **shapes,
            "rope_scaling": None if rope_scaling is None else dict(vars(rope_scaling)),
            "tie_word_embeddings": False,
            "torch_dtype": self.backbone.torch_dtype,
            "bos_token_id": self.backbone.bos_token_id,
            "eos_token_id": list(self.backbone.eos_token_ids),
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "num_target_layers": self.num_target_layers,
            "num_anchors": self.num_anchors,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            **({} if self.context_window is None else {"sparkwire_context_window": self.context_window}),
        }


def default_target_layer_ids(num_target_layers: int, num_context_layers: int) -> tuple[int, ...]:
    """K layers evenly spread from 1 to L - 3 (Qwen3-4B, L = 36, K = 5: 1, 9, 17, 25, 33)."""
    _check(num_target_layers >= 4, f"a DSpark target needs >= 4 layers, got {num_target_layers}")
    if num_context_layers == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    step = (last - first) / (num_context_layers - 1)
    return tuple(int(round(first + i * step)) for i in range(num_context_layers))


def _refuse_other_conventions(raw: dict[str, Any]) -> None:
    if raw.get("speculators_model_type"):
        raise UnsupportedModelError(
            "this draft was trained in the speculators convention (slot j predicts anchor + j, slot 0 unused); "
            "DeepSpec's, used here, has slot k predict anchor + k + 1: it would load but draft one position "
            "off (accept length ~1), so it is refused"
        )
    layer_types = raw.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise UnsupportedModelError(f"draft layer_types {layer_types}: only full_attention layers are supported")


def _check_layer_ids(layer_ids: tuple[int, ...], num_target_layers: int) -> None:
    _check(len(layer_ids) > 0, "target_layer_ids must not be empty")
    _check(all(EMBEDDING_LAYER <= i < num_target_layers for i in layer_ids),
           f"target_layer_ids {list(layer_ids)} out of range [-1, {num_target_layers - 1}] (-1: the embedding output)")
    _check(all(a < b for a, b in zip(layer_ids, layer_ids[1:])),
           f"target_layer_ids {list(layer_ids)} must be strictly increasing")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise DraftConfigError(message)


def draft_config_for_target(
    target: ModelConfig,
    *,
    num_draft_layers: int,
    mask_token_id: int,
    block_size: int = 7,
    target_layer_ids: tuple[int, ...] | None = None,
    markov_rank: int = 256,
    enable_confidence_head: bool = True,
    num_anchors: int = DEFAULT_NUM_ANCHORS,
) -> DSparkConfig:
    """A new drafter's config, as DeepSpec builds one: the target's Qwen3 shapes with fewer layers.

    Context layers default to one per draft layer, evenly spread (DFlash's convention).
    """
    layer_ids = target_layer_ids or default_target_layer_ids(target.num_hidden_layers, num_draft_layers)
    # Qwen3 layers whatever the target's family: full attention, SiLU, no soft-capping, one RoPE.
    backbone = replace(target, architecture="Qwen3ForCausalLM", num_hidden_layers=num_draft_layers, qk_norm=True,
                       tie_word_embeddings=False, layer_types=(), sliding_window=None, attention_scale=None,
                       attn_logit_softcap=None, final_logit_softcap=None, hidden_act="silu", local_rope_theta=None)  # fmt: skip
    config = DSparkConfig(
        backbone=backbone, block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=tuple(layer_ids),
        num_target_layers=target.num_hidden_layers, markov_rank=markov_rank,
        enable_confidence_head=enable_confidence_head, confidence_head_with_markov=enable_confidence_head and markov_rank > 0,
        num_anchors=num_anchors,
    )  # fmt: skip
    config.check_target(target)
    return config
