"""Train the DSpark drafter on a frozen target, as published (FIELD-NOTES.md, "Training").

    python -m ops.train.train_drafter --corpus /tmp/corpus --target ops/models/sparkwire-micro \
        --recipe micro --seed 0 --out ops/models/sparkwire-micro-dspark --results .../drafter_seed0.json

The drafter is the serving module itself (`services.scheduler.spec.dspark_model.DSparkDrafter`,
its `forward_train`), so training and serving share every line of the drafter's math. Per step:

1. A batch of sequences [B, S]: real corpus windows, and (a `distill_fraction` of them) prompts
   the target continued itself, half greedily and half at T = 1 (self-distillation: the drafter
   learns the distribution it will be verified against, on text like what it will see).
2. The frozen target runs once: its logits (p, at T = 1) and the outputs of the K
   `target_layer_ids` layers (pre final norm, as the serving runtime captures them).
3. A anchors per sequence at random positions; the drafter drafts gamma slots from each, slot k
   predicting the token at anchor + k + 1 with prev teacher-forced.
4. Loss per slot: 0.1 CE(label) + 0.9 TV(p, q) + 1.0 BCE(confidence, 1 - TV), weighted by
   exp(-k / 4) and averaged over the valid slots (a block may run past the sequence's end).

The target's embedding and LM head are shared and frozen; only the drafter's own weights train.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from ops.train.common import (
    add_run_arguments,
    adamw,
    autocast,
    eval_windows,
    load_hf_target,
    pick_device,
    run_recipe,
    sample_windows,
    seed_everything,
    steps_run,
    token_stream,
    train_loop,
    write_json,
    write_results,
)
from ops.train.recipes import DRAFTERS, DrafterRecipe
from ops.train.tokenizer import MASK
from services.scheduler.model.config import ModelConfig
from services.scheduler.spec.dspark_config import EMBEDDING_LAYER, default_target_layer_ids, draft_config_for_target
from services.scheduler.spec.dspark_loader import save_drafter
from services.scheduler.spec.dspark_model import DSparkDrafter, block_positions, draft_targets

LOSS_WEIGHTS = {"ce": 0.1, "tv": 0.9, "bce": 1.0}
POSITION_DECAY = 4.0  # w_k = exp(-k / POSITION_DECAY)
GENERATE_BATCH = 4096  # rows per generation batch (bf16 K+V of 4096 x 256 tokens: ~2 GB micro, ~5.4 GB large)
INIT_STD = 0.02


class TargetFeatures:
    """The frozen HF target's logits and captured layer outputs for a batch of sequences."""

    def __init__(self, model: torch.nn.Module, layer_ids: tuple[int, ...]) -> None:
        self.model, self.layer_ids = model, layer_ids
        self.captured: dict[int, torch.Tensor] = {}
        for index in layer_ids:
            if index == EMBEDDING_LAYER:  # the embedding output: what layer 0 reads (scaled, for Gemma)
                model.model.layers[0].register_forward_pre_hook(self._input_hook(index), with_kwargs=True)
            else:
                model.model.layers[index].register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def capture(_module, _inputs, output):
            self.captured[index] = output[0] if isinstance(output, tuple) else output  # [B, S, H]

        return capture

    def _input_hook(self, index: int):
        def capture(_module, args, kwargs):
            self.captured[index] = args[0] if args else kwargs["hidden_states"]  # [B, S, H]

        return capture

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, S] -> (logits f32 [B, S, V], features [B, S, K*H])."""
        with autocast(device):
            logits = self.model(input_ids=ids).logits.float()
        features = torch.cat([self.captured.pop(i) for i in self.layer_ids], dim=-1)
        return logits, features


@torch.no_grad()
def continue_with_target(
    model: torch.nn.Module, prompts: torch.Tensor, num_new: int, greedy: torch.Tensor, device, generator
) -> torch.Tensor:
    """prompts [N, P] -> [N, P + num_new]: the target's own continuation (greedy rows: argmax; others: T = 1)."""
    out = []
    for rows, row_greedy in zip(prompts.split(GENERATE_BATCH), greedy.split(GENERATE_BATCH)):
        ids = rows.to(device)
        with autocast(device):
            step = model(input_ids=ids, use_cache=True)
        cache, new = step.past_key_values, []
        for _ in range(num_new):
            logits = step.logits[:, -1].float()  # [n, V]
            noise = torch.empty_like(logits).exponential_(generator=generator)  # Gumbel-max via Exp(1)
            sampled = (logits.softmax(-1) / noise).argmax(-1)
            token = torch.where(row_greedy.to(device), logits.argmax(-1), sampled)[:, None]
            new.append(token)
            with autocast(device):
                step = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache = step.past_key_values
        out.append(torch.cat([ids, *new], dim=1).cpu())
    return torch.cat(out)


def build_drafter(target_dir: Path, model: torch.nn.Module, recipe: DrafterRecipe, mask_id: int) -> DSparkDrafter:
    target_config = ModelConfig.from_pretrained(target_dir)
    layer_ids = recipe.target_layer_ids or default_target_layer_ids(target_config.num_hidden_layers, recipe.num_target_features)
    config = draft_config_for_target(
        target_config, num_draft_layers=recipe.num_layers, mask_token_id=mask_id, block_size=recipe.block_size,
        target_layer_ids=tuple(layer_ids), markov_rank=recipe.markov_rank, enable_confidence_head=True,
        num_anchors=recipe.anchors_per_seq,
    )  # fmt: skip
    drafter = DSparkDrafter(config, model.model.embed_tokens, model.lm_head.weight)
    init_weights(drafter)
    return drafter.to(model.lm_head.weight.device)


@torch.no_grad()
def init_weights(drafter: DSparkDrafter) -> None:
    """Matrices N(0, 0.02), norms 1, biases 0; W2 = 0 so the Markov bias starts at nothing."""
    for name, param in drafter.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias") or name == "markov_head.markov_w2.weight":
            param.zero_()
        else:
            param.normal_(0.0, INIT_STD)


def random_anchors(batch: int, seq_len: int, count: int, device, generator: torch.Generator) -> torch.Tensor:
    """[B, A] distinct sorted positions in [0, S - 2] (each anchor has at least one label)."""
    order = torch.rand(batch, seq_len - 1, generator=generator).argsort(dim=1)[:, :count]
    return order.sort(dim=1).values.to(device)


def dspark_loss(drafter, logits_p, features, ids, anchors) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The published loss (module docstring, step 4) and per-term means for logging."""
    gamma, vocab = drafter.num_draft_tokens, logits_p.shape[-1]
    out = drafter.forward_train(features, ids, anchors)  # logits [B, A, gamma, V]
    labels, valid = draft_targets(ids, anchors, gamma)  # [B, A, gamma]
    # Slot k predicts position a + k + 1, which the target's row a + k predicts.
    rows = block_positions(anchors, gamma).clamp_max(ids.shape[1] - 1).flatten(1)  # [B, A*gamma]
    p = logits_p.gather(1, rows[..., None].expand(-1, -1, vocab)).view(out.logits.shape).softmax(-1)
    log_q = out.logits.log_softmax(-1)
    ce = -log_q.gather(-1, labels[..., None])[..., 0]
    tv = 0.5 * (p - log_q.exp()).abs().sum(-1)
    bce = F.binary_cross_entropy_with_logits(out.confidence, (1.0 - tv).detach(), reduction="none")
    position = torch.exp(-torch.arange(gamma, device=ids.device) / POSITION_DECAY)  # [gamma]
    weight = position * valid  # [B, A, gamma]
    terms = {"ce": ce, "tv": tv, "bce": bce}
    loss = sum(LOSS_WEIGHTS[name] * term for name, term in terms.items())
    total = (loss * weight).sum() / weight.sum()
    stats = {name: (term * valid).sum() / valid.sum() for name, term in terms.items()}
    stats["greedy_accept"] = teacher_forced_accept(out.logits, p, valid)
    return total, stats


def teacher_forced_accept(q_logits: torch.Tensor, p: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """1 + mean leading run of slots whose draft argmax equals the target argmax (a cheap proxy)."""
    match = (q_logits.argmax(-1) == p.argmax(-1)) & valid  # [B, A, gamma]
    return 1.0 + match.long().cumprod(dim=-1).sum(-1).float().mean()


class Batches:
    """Each step's sequences: a share from the self-distilled pool, the rest real windows."""

    def __init__(self, recipe: DrafterRecipe, stream: torch.Tensor, pool: torch.Tensor, generator) -> None:
        self.recipe, self.stream, self.pool, self.generator = recipe, stream, pool, generator
        self.num_distilled = round(recipe.batch_size * recipe.distill_fraction) if pool.numel() else 0

    def next(self) -> torch.Tensor:
        real = sample_windows(self.stream, self.recipe.batch_size - self.num_distilled, self.recipe.seq_len, self.generator)
        picks = torch.randint(0, max(1, self.pool.shape[0]), (self.num_distilled,), generator=self.generator)
        return torch.cat((real, self.pool[picks])) if self.num_distilled else real


def distilled_pool(model, recipe: DrafterRecipe, stream: torch.Tensor, device, generator) -> torch.Tensor:
    """[N, seq_len] target continuations of real prompts (N = one pass's worth of distilled rows)."""
    count = round(recipe.batch_size * recipe.distill_fraction * recipe.steps / recipe.pool_reuse)
    if count == 0:
        return torch.empty(0, recipe.seq_len, dtype=torch.int64)
    prompts = sample_windows(stream, count, recipe.distill_prompt_len, generator)
    greedy = torch.arange(count) % 2 == 0
    device_generator = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
    return continue_with_target(model, prompts, recipe.distill_new_tokens, greedy, device, device_generator)


def batch_loss(drafter, features_of, ids: torch.Tensor, recipe: DrafterRecipe, device, generator):
    """The loss (and its stats) on sequences ids [B, S]: target features, random anchors, drafts."""
    ids = ids.to(device, non_blocking=True)
    logits_p, features = features_of(ids, device)
    anchors = random_anchors(ids.shape[0], ids.shape[1], recipe.anchors_per_seq, device, generator)
    with autocast(device):
        return dspark_loss(drafter, logits_p, features, ids, anchors)


@torch.no_grad()
def held_out(drafter, features_of, windows: torch.Tensor, recipe: DrafterRecipe, device) -> dict[str, float]:
    generator = torch.Generator().manual_seed(1234)  # the same anchors at every evaluation
    drafter.eval()
    sums: dict[str, float] = {}
    chunks = windows.split(recipe.batch_size)
    for chunk in chunks:
        loss, stats = batch_loss(drafter, features_of, chunk, recipe, device, generator)
        for name, value in {"loss": loss, **stats}.items():
            sums[name] = sums.get(name, 0.0) + float(value) / len(chunks)
    drafter.train()
    return sums


def train(drafter, features_of, recipe: DrafterRecipe, batches: Batches, held_out_windows, device,
          max_seconds: float | None = None) -> dict:  # fmt: skip
    """The shared loop on dspark_loss; returns {"train": [...], "eval": [...], "eval_greedy_accept": [...]}."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = adamw(params, recipe.lr, recipe.weight_decay)
    generator = torch.Generator().manual_seed(batches.generator.initial_seed() + 1)

    def step_loss() -> torch.Tensor:
        return batch_loss(drafter, features_of, batches.next(), recipe, device, generator)[0]

    def evaluate() -> dict[str, float]:
        scores = held_out(drafter, features_of, held_out_windows, recipe, device)
        return {"eval": scores["loss"], "eval_greedy_accept": scores["greedy_accept"]}

    return train_loop(drafter, params, optimizer, recipe, step_loss, evaluate, "drafter", max_seconds)


def save(drafter: DSparkDrafter, out: Path, recipe_name: str, recipe: DrafterRecipe, seed: int) -> None:
    save_drafter(drafter.to(torch.bfloat16), out)  # shared target tensors are not the drafter's: untouched
    config_path = out / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    # the window it attends to when serving: what its training sequences held (dspark_config)
    config.update({"torch_dtype": "bfloat16", "sparkwire_weights": "trained", "sparkwire_recipe": recipe_name,
                   "sparkwire_seed": seed, "sparkwire_context_window": recipe.seq_len})  # fmt: skip
    write_json(config_path, config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--target", type=Path, required=True, help="the trained target's directory (HF layout)")
    add_run_arguments(parser, DRAFTERS, out_help="the draft model directory to write")
    args = parser.parse_args(argv)
    recipe, device = run_recipe(DRAFTERS, args), pick_device(args.device)
    seed_everything(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    model = load_hf_target(args.target, device).requires_grad_(False)
    train_tokens = token_stream(tokenizer, args.corpus, "train")
    eval_tokens = token_stream(tokenizer, args.corpus, "eval")
    drafter = build_drafter(args.target, model, recipe, tokenizer.token_to_id(MASK))
    features_of = TargetFeatures(model, drafter.config.target_layer_ids)
    started = time.perf_counter()
    pool = distilled_pool(model, recipe, train_tokens, device, generator)
    distill_seconds = time.perf_counter() - started
    batches = Batches(recipe, train_tokens, pool, generator)
    held_out_windows = eval_windows(eval_tokens, recipe.seq_len, recipe.eval_windows)
    history = train(drafter, features_of, recipe, batches, held_out_windows, device, args.max_seconds)
    seconds = time.perf_counter() - started
    save(drafter, args.out, args.recipe, recipe, args.seed)
    parameters = sum(p.numel() for p in drafter.parameters())
    figures = {
        "target_layer_ids": list(drafter.config.target_layer_ids), "parameters": parameters,
        "distilled_sequences": pool.shape[0], "distill_seconds": round(distill_seconds, 1), "steps_run": steps_run(history),
        "train_seconds": round(seconds, 1), "final_train_loss": history["train"][-1][1],
        "final_eval_loss": history["eval"][-1][1],
        "final_eval_teacher_forced_greedy_accept": history["eval_greedy_accept"][-1][1],
        "loss_weights": LOSS_WEIGHTS, "position_decay": POSITION_DECAY,
    }  # fmt: skip
    curves = {"train": history["train"], "held-out": history["eval"]}
    results = write_results(args, recipe, curves, f"DSpark drafter ({args.recipe}, seed {args.seed})", figures, history)
    print(f"drafter {args.recipe} seed {args.seed}: {parameters:,} params, {results['steps_run']} of {recipe.steps} steps, "
          f"{seconds:.0f} s, train loss "
          f"{results['final_train_loss']:.3f}, held-out loss {results['final_eval_loss']:.3f}, teacher-forced "
          f"greedy accept {results['final_eval_teacher_forced_greedy_accept']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
