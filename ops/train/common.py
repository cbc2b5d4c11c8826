"""What the training scripts share: seeding, the token stream, batches, the schedule, the
optimisation loop, the CLI flags of a run and its outputs. What each script trains (the model, its
loss, its held-out score, its checkpoint) stays in the script."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import torch
from tokenizers import Tokenizer

from ops.train.corpus import read_split
from ops.train.recipes import DrafterRecipe, TargetRecipe
from ops.train.tokenizer import END_OF_TEXT

LOG_EVERY = 50  # steps between host reads of the training loss (each read is a device sync)
BETAS = (0.9, 0.95)
CLIP_NORM = 1.0
Recipe = TypeVar("Recipe", TargetRecipe, DrafterRecipe)
History = dict[str, list[tuple[int, float]]]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast(device: torch.device) -> torch.autocast:
    """bf16 matmuls on CUDA (master weights stay fp32); plain fp32 on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def load_hf_target(model_dir: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The target as transformers loads it (so every use also checks the checkpoint is HF-loadable)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]


def token_stream(tokenizer: Tokenizer, corpus_dir: Path, split: str) -> torch.Tensor:
    """Every document of a split, each followed by END_OF_TEXT, as one int64 tensor [N]."""
    eot = tokenizer.token_to_id(END_OF_TEXT)
    docs = encode_documents(tokenizer, [text for _, text in read_split(corpus_dir, split)])
    return torch.tensor([token for doc in docs for token in (*doc, eot)], dtype=torch.int64)


def sample_windows(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, length] windows of the stream at uniformly random starts (drawn on the host)."""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=generator)
    return stream[starts[:, None] + torch.arange(length)]


def eval_windows(stream: torch.Tensor, length: int, limit: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping [n, length] windows from the start (the tail is dropped)."""
    count = stream.numel() // length if limit is None else min(limit, stream.numel() // length)
    return stream[: count * length].view(count, length)


def lr_at(step: int, peak: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warm-up to `peak`, then cosine down to floor·peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float, decay_vectors: bool = True) -> torch.optim.AdamW:
    """AdamW at BETAS; `decay_vectors=False` decays matrices only (norms and biases keep 0)."""
    if decay_vectors:
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=weight_decay)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS)


def train_loop(
    module: torch.nn.Module, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
    recipe: TargetRecipe | DrafterRecipe, step_loss: Callable[[], torch.Tensor],
    evaluate: Callable[[], Mapping[str, float]], desc: str, max_seconds: float | None = None,
) -> History:  # fmt: skip
    """`recipe.steps` optimiser steps on `step_loss()` (the next batch's loss, under autocast) at the
    lr_at schedule, gradients clipped to CLIP_NORM over `params`. Returns {"train": [(step, mean
    loss over the last LOG_EVERY steps)], then one list per name `evaluate()` returns, a point every
    `recipe.eval_every` steps}; both also at the last step. `module` trains throughout: `evaluate`
    leaves it in training mode. `max_seconds`: the first step ending past that much time is the
    last (the schedule stays the recipe's, cut short; `steps_run` says where)."""
    history: History = {"train": []}
    running = torch.zeros((), device=params[0].device)  # summed on the device: no sync per step
    bar = progress(recipe.steps, desc)
    module.train()
    started = time.monotonic()
    for step in range(recipe.steps):
        set_lr(optimizer, lr_at(step, recipe.lr, recipe.warmup_steps, recipe.steps))
        loss = step_loss()
        optimizer_step(loss, params, optimizer)
        running += loss.detach()
        out_of_time = max_seconds is not None and time.monotonic() - started > max_seconds
        done, last = step + 1, step + 1 == recipe.steps or out_of_time
        if done % LOG_EVERY == 0 or last:
            history["train"].append((done, float(running) / ((step % LOG_EVERY) + 1)))
            running.zero_()
            bar.set_postfix(loss=f"{history['train'][-1][1]:.3f}")
        if done % recipe.eval_every == 0 or last:
            for name, value in evaluate().items():
                history.setdefault(name, []).append((done, value))
        bar.update(1)
        if last:
            break
    bar.close()
    return history


def steps_run(history: History) -> int:
    """Optimiser steps a `train_loop` ran (fewer than the recipe's where `max_seconds` cut it)."""
    return history["train"][-1][0]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_step(loss: torch.Tensor, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def add_run_arguments(parser: argparse.ArgumentParser, recipes: Mapping[str, object], out_help: str) -> None:
    """The flags every training script takes after its inputs: which recipe, seed, device, where to."""
    parser.add_argument("--recipe", choices=tuple(recipes), default="micro")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's step count (timing runs)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop at the first step ending past this many seconds of training (the schedule stays the "
                             "recipe's; the results JSON's steps_run says how many ran)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override one recipe field (sweeps; repeatable; the results JSON's recipe_settings "
                             "holds the fields it ran with)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--out", type=Path, required=True, help=out_help)
    parser.add_argument("--results", type=Path, required=True, help="results JSON (the loss PNG goes beside it)")


def run_recipe(recipes: Mapping[str, Recipe], args: argparse.Namespace) -> Recipe:
    """The named recipe, with each `--set FIELD=VALUE`, then `--steps` (warm-up shortened to fit)."""
    recipe = apply_overrides(recipes[args.recipe], args.overrides)
    if args.steps is None:
        return recipe
    return dataclasses.replace(recipe, steps=args.steps, warmup_steps=min(recipe.warmup_steps, args.steps - 1))


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """`FIELD=VALUE` pairs parsed as the field's current value's type (ints, floats, int tuples)."""
    if not overrides:
        return recipe
    fields = {field.name: getattr(recipe, field.name) for field in dataclasses.fields(recipe)}
    changes: dict[str, object] = {}
    for item in overrides:
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}")
        current = fields[name]
        try:
            if isinstance(current, tuple) or current is None:
                changes[name] = tuple(int(part) for part in text.split(",") if part) or None
            else:
                changes[name] = type(current)(text)
        except ValueError as error:
            raise SystemExit(f"--set {item!r}: {error}") from None
    return dataclasses.replace(recipe, **changes)  # __post_init__ checks the combination


def write_results(
    args: argparse.Namespace, recipe: TargetRecipe | DrafterRecipe, curves: History, title: str, figures: dict,
    history: dict,
) -> dict:  # fmt: skip
    """The loss PNG of `curves` beside `args.results`, then the results JSON: the run's recipe and
    seed, the script's `figures`, the PNG's name (None without matplotlib), history, environment."""
    png = args.results.with_suffix(".png")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    wrote_png = write_loss_curve(png, curves, title)
    results = {
        "recipe": args.recipe, "seed": args.seed, "recipe_settings": dataclasses.asdict(recipe), **figures,
        "loss_curve_png": png.name if wrote_png else None, "history": history, "environment": environment(),
    }  # fmt: skip
    write_json(args.results, results)
    return results


def progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, mininterval=2.0, dynamic_ncols=False, ncols=100)


def write_loss_curve(path: Path, curves: dict[str, list[tuple[int, float]]], title: str) -> bool:
    """A PNG of each named (step, loss) curve; False (and no file) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        if points:
            axes.plot(*zip(*points), label=name)
    axes.set(xlabel="step", ylabel="loss", title=title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def environment() -> dict:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"python": platform.python_version(), "torch": torch.__version__, "device": device}


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
