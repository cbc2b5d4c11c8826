"""Load and save DSpark drafters: DeepSpec-layout safetensors checkpoints, or seeded random weights.

A draft directory holds `config.json` (see dspark_config) and `*.safetensors` (one file, or shards
in `model.safetensors.index.json`). load_format "auto" reads the safetensors, or, for a directory
whose config says `"sparkwire_weights": "seeded-random"`, draws them from `sparkwire_seed`;
"dummy" always draws random weights (normal(0, 0.02), norms 1) from the config and `seed`.

Parameter names, as in DeepSpec's Qwen3DSparkModel checkpoints (SGLang's Qwen3DSparkModel loads the
same names); i = draft layer, V = vocab, H = hidden, K = len(target_layer_ids), r = markov_rank:

    fc.weight                                   [H, K*H]   context projection
    hidden_norm.weight                          [H]        RMSNorm after fc
    layers.i.input_layernorm.weight             [H]
    layers.i.self_attn.{q,k,v,o}_proj.weight    Qwen3 shapes (+ .bias when attention_bias)
    layers.i.self_attn.{q,k}_norm.weight        [head_dim]
    layers.i.post_attention_layernorm.weight    [H]
    layers.i.mlp.{gate,up,down}_proj.weight     Qwen3 shapes (gate/up fused here, sliced on load)
    norm.weight                                 [H]        before the (target's) LM head
    markov_head.markov_w1.weight                [V, r]     W1, an embedding      (markov_rank > 0)
    markov_head.markov_w2.weight                [V, r]     W2, a linear r -> V
    markov_head.gate_proj.{weight,bias}         [r, H + r], [r]     (markov_head_type "gated")
    markov_head.joint_proj.{weight,bias}        [3r, 2r + H], [3r]  (markov_head_type "rnn")
    confidence_head.proj.weight                 [1, H (+ r with_markov)]         (enable_confidence_head)
    confidence_head.proj.bias                   [1]

Published checkpoints also carry `embed_tokens.weight` and `lm_head.weight` (frozen copies of the
target's); they are ignored here: the drafter uses the target's own, and `save_drafter` leaves
them out. A missing tensor the config needs (a confidence head the config enables, say) raises
`MissingTensorError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from services.scheduler.spec.calibration import load_temperature
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.kv_cache import bytes_per_block
from services.scheduler.model.llama import rope_inv_freq
from services.scheduler.flags import LOAD_FORMATS
from services.scheduler.model.loader import MemoryReserve, NoWeightsError, fill_random_weights, load_safetensors
from services.scheduler.model.batch_invariant import Linear
from services.scheduler.model.runner import ModelRunner
from services.scheduler.model.tensor_parallel import TensorParallel, check_shardable, shard_config
from services.scheduler.spec.dspark import DSparkProposer
from services.scheduler.spec.dspark_config import DSparkConfig
from services.scheduler.spec.dspark_model import DSparkDrafter

WEIGHTS_FILE = "model.safetensors"
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")  # published drafts' frozen copies of the target's
MARKOV_W2 = "markov_head.markov_w2.weight"


def load_dspark_proposer(
    path: str | Path, runner: ModelRunner, *, load_format: str = "auto", seed: int = 0, num_draft_tokens: int | None = None,
    context_window: int | None = None, confidences: bool = True,
) -> DSparkProposer:
    """The drafter at `path`, on the runner's device and dtype, with a KV cache shaped like the runner's;
    context_window None: the draft config's, 0: the whole context (`DSparkProposer`); confidences:
    whether its blocks carry them (`compact`), calibrated by the temperature beside it. A runner that
    holds one rank's shard of a tensor-parallel group gets this rank's shard of the drafter (`shard_drafter`)."""
    drafter = load_drafter(
        path, runner.model.model.embed_tokens, runner.lm_head_weight, runner.config,
        load_format=load_format, seed=seed, logit_softcap=runner.config.final_logit_softcap, tp=runner.model.tp,
    )  # fmt: skip
    temperature = load_temperature(path) if confidences else None
    return DSparkProposer(drafter, runner.num_blocks, runner.block_size, num_draft_tokens, context_window, temperature)


def drafter_memory(
    path: str | Path, target_config: ModelConfig, dtype: torch.dtype, block_size: int, tp_size: int = 1, max_rows: int = 0
) -> MemoryReserve:
    """What the drafter at `path` will hold on the device besides the target (its weights, the
    vocabulary-wide tensors of a step at `max_rows` running requests, and its KV cache per block),
    known before the target loads, so the target's KV cache leaves room for it (one rank's shard of
    the layers and KV heads where `tp_size` > 1; the Markov head counted whole)."""
    config = DSparkConfig.from_pretrained(Path(path))
    config.check_target(target_config)
    if tp_size > 1:
        config = replace(config, backbone=shard_config(config.backbone, tp_size))
    with torch.device("meta"):
        embed = nn.Embedding(target_config.vocab_size, target_config.hidden_size)
        drafter = DSparkDrafter(config, embed, torch.empty(target_config.vocab_size, target_config.hidden_size)).to(dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters())  # shares no target tensor
    step_bytes = draft_step_bytes(max_rows, config.block_size, target_config.vocab_size, dtype)
    return MemoryReserve(weight_bytes, bytes_per_block(config.backbone, block_size, dtype), step_bytes)


def draft_step_bytes(max_rows: int, gamma: int, vocab_size: int, dtype: torch.dtype) -> int:
    """Bytes of the vocabulary-wide tensors one DSpark step holds at once at `max_rows` running
    requests (f32 unless said), per row of the vocabulary:

    - verify logits [R, gamma + 1, V] (a decode graph's shared buffer, or a compact step's rows),
      and the LM head's product in `dtype` before them;
    - the drafter's base logits [R, gamma, V], and the LM head's product in `dtype` before them;
    - sampled requests' q [R, gamma, V] of the blocks being verified (kept since they were drafted),
      and of the blocks being drafted;
    - one draft slot's rows [R, V]: the Markov bias, the corrected logits, q, and its f64 CDF (two).
    """
    f32 = torch.float32.itemsize
    per_row = (2 * gamma + 1) * (f32 + dtype.itemsize) + 2 * gamma * f32 + 5 * f32
    return max_rows * vocab_size * per_row


def load_drafter(
    path: str | Path,
    embed_tokens: nn.Module,
    lm_head_weight: torch.Tensor,
    target_config: ModelConfig,
    *,
    load_format: str = "auto",
    seed: int = 0,
    logit_softcap: float | None = None,
    tp: TensorParallel | None = None,
) -> DSparkDrafter:
    """Build the drafter of `path` on the device and dtype of the target's LM head, checked against the
    target; logit_softcap: the target's final soft-cap, which its head applies (Gemma 2); tp: the
    target's group, whose embedding and LM head shards these are (None: the whole drafter)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    draft_dir = Path(path)
    config = DSparkConfig.from_pretrained(draft_dir)
    config.check_target(target_config)
    if tp is not None:
        check_shardable(config.backbone, tp.size)
    draft_tp = None if tp is None else DraftParallel(tp.rank, tp.size, tp.group, config.backbone, tp.explain)
    drafter = empty_drafter(config, embed_tokens, lm_head_weight, logit_softcap, draft_tp)
    _fill_weights(drafter, draft_dir, load_format, seed, draft_tp)
    return drafter.eval()


def empty_drafter(
    config: DSparkConfig, embed_tokens: nn.Module, lm_head_weight: torch.Tensor, logit_softcap: float | None = None,
    tp: DraftParallel | None = None,
) -> DSparkDrafter:
    """Uninitialised weights on the LM head's device and dtype (built on meta: no wasted init kernels)."""
    with torch.device("meta"):
        if tp is None:
            drafter = DSparkDrafter(config, embed_tokens, lm_head_weight, logit_softcap)
        else:
            drafter = shard_drafter(config, embed_tokens, lm_head_weight, logit_softcap, tp)
        drafter = drafter.to(lm_head_weight.dtype)
    drafter = drafter.to_empty(device=lm_head_weight.device)
    drafter.rope_inv_freq = rope_inv_freq(config.backbone).to(lm_head_weight.device)  # fp32, like the target's
    return drafter


def shard_drafter(config: DSparkConfig, embed_tokens: nn.Module, lm_head_weight: torch.Tensor, logit_softcap: float | None,
                  tp: DraftParallel) -> DSparkDrafter:  # fmt: skip
    """One rank's drafter (on the meta device), laid out as the target is (`tensor_parallel.py`): each
    draft layer's q/k/v and gate/up column-parallel (KV heads split, or replicated where fewer than
    ranks), o/down row-parallel with one all-reduce each; the Markov head's W2 (r -> V) vocabulary-
    parallel like the target's LM head, whose shard it reads with the target's vocabulary-parallel
    embedding. Replicated on every rank (no collective): fc and its norm (the captured target rows are
    whole on every rank, so injecting the context costs no communication), the norms, the Markov
    head's W1 and gate/joint projections, the confidence head."""
    drafter = DSparkDrafter(replace(config, backbone=shard_config(config.backbone, tp.size)), embed_tokens, lm_head_weight,
                            logit_softcap)  # fmt: skip
    for layer in drafter.layers:
        layer.tp = tp
    if drafter.markov_head is not None:
        drafter.markov_head.markov_w2 = Linear(config.markov_rank, tp.vocab_shard, bias=False)
    drafter.tp = tp
    return drafter


@dataclass(frozen=True)
class DraftParallel(TensorParallel):
    """The target's group, slicing a drafter's checkpoint (`config`: the whole draft backbone's shapes)."""

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name == MARKOV_W2:
            return self._vocab_rows(full)
        if name.startswith("markov_head."):
            return full  # the Markov head's own projections (a gated head's gate_proj among them): every rank's whole
        return super().shard(name, full)


def _fill_weights(drafter: DSparkDrafter, draft_dir: Path, load_format: str, seed: int, tp: DraftParallel | None) -> None:
    backbone = drafter.config.backbone
    shapes = None if tp is None else _whole_shapes(drafter, tp)
    if load_format == "dummy":
        fill_random_weights(drafter, seed, tp, shapes)
    elif any(draft_dir.glob("*.safetensors")):
        load_safetensors(drafter, draft_dir, ignored=TARGET_COPIES, tp=tp)
    elif backbone.sparkwire_weights == "seeded-random":
        fill_random_weights(drafter, backbone.sparkwire_seed, tp, shapes)
    else:
        raise NoWeightsError(f"no *.safetensors files in draft directory {draft_dir}; pass --load-format dummy")


def _whole_shapes(drafter: DSparkDrafter, tp: DraftParallel) -> dict[str, torch.Size]:
    """The whole drafter's checkpoint shapes: a sharded drafter's random weights are slices of them."""
    config = replace(drafter.config, backbone=tp.config)
    with torch.device("meta"):
        whole = DSparkDrafter(config, drafter.target.embed_tokens, drafter.target.lm_head_weight)
    return {name: tensor.shape for name, tensor in whole.checkpoint_tensors()}


def save_drafter(drafter: DSparkDrafter, directory: str | Path) -> Path:
    """Write config.json and model.safetensors (DeepSpec names, no embedding or LM head); returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config_text = json.dumps(drafter.config.to_dict(), indent=2) + "\n"
    (directory / "config.json").write_text(config_text, encoding="utf-8")
    tensors = {name: tensor.detach().contiguous().cpu().clone() for name, tensor in drafter.checkpoint_tensors()}
    save_file(tensors, str(directory / WEIGHTS_FILE))
    return directory
