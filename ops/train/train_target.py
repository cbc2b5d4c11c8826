"""Train the target: a Qwen3-layout causal LM on the corpus, saved in Hugging Face format.

    python -m ops.train.train_target --corpus /tmp/corpus --tokenizer ops/models/sparkwire-micro \
        --recipe micro --seed 0 --out ops/models/sparkwire-micro --results ops/models/sparkwire-micro/training/target_seed0.json

The model is transformers' `Qwen3ForCausalLM` (so the checkpoint is one transformers loads by
construction); the output directory gets `config.json`, `generation_config.json`,
`model.safetensors` (bf16; the tied LM head is not stored twice) and the tokenizer files. Next to
the results JSON go the loss curve (`<results>.png`) and the per-step history.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from ops.train.common import (
    add_run_arguments,
    adamw,
    autocast,
    eval_windows,
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
from ops.train.recipes import TARGETS, TargetRecipe
from ops.train.tokenizer import END_OF_TEXT, IM_END, MODEL_MAX_LENGTH

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_config(recipe: TargetRecipe, tokenizer: Tokenizer, recipe_name: str, seed: int) -> dict:
    """config.json in the classic key set, which this repo's loader and transformers both read."""
    eos = [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(END_OF_TEXT)]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": recipe.hidden_size,
        "intermediate_size": recipe.intermediate_size,
        "num_hidden_layers": recipe.num_layers,
        "num_attention_heads": recipe.num_heads,
        "num_key_value_heads": recipe.num_kv_heads,
        "head_dim": recipe.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "rope_theta": recipe.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": eos[1],
        "eos_token_id": eos,
        "sparkwire_weights": "trained",
        "sparkwire_recipe": recipe_name,
        "sparkwire_seed": seed,
    }


def build_model(config: dict, device: torch.device) -> torch.nn.Module:
    import transformers

    fields = {k: v for k, v in config.items() if not k.startswith("sparkwire_") and k not in ("architectures", "torch_dtype")}
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields))
    return model.to(device)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, windows: torch.Tensor, device: torch.device, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over the windows [n, S]."""
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(batch):
        chunk = chunk.to(device)
        with autocast(device):
            logits = model(input_ids=chunk).logits.float()  # [b, S, V]
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total, count = total + float(losses), count + chunk[:, 1:].numel()
    model.train()
    return total / count


def train(
    model: torch.nn.Module, recipe: TargetRecipe, train_tokens: torch.Tensor, eval_tokens: torch.Tensor,
    device: torch.device, seed: int, max_seconds: float | None = None,
) -> dict:  # fmt: skip
    """The shared loop on next-token cross-entropy; returns {"train": [(step, loss)], "eval": [...]}."""
    generator = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    # Matrices decay; norms (and nothing else: there are no biases) do not.
    optimizer = adamw(params, recipe.lr, recipe.weight_decay, decay_vectors=False)
    held_out = eval_windows(eval_tokens, recipe.seq_len, recipe.eval_windows)

    def step_loss() -> torch.Tensor:
        batch = sample_windows(train_tokens, recipe.batch_size, recipe.seq_len, generator).to(device, non_blocking=True)
        with autocast(device):
            return model(input_ids=batch, labels=batch).loss

    def evaluate() -> dict[str, float]:
        return {"eval": held_out_loss(model, held_out, device)}

    return train_loop(model, params, optimizer, recipe, step_loss, evaluate, "target", max_seconds)


def save_checkpoint(model: torch.nn.Module, config: dict, tokenizer_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to(torch.bfloat16).cpu().contiguous() for name, tensor in model.state_dict().items()}
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)  # the same tensor as model.embed_tokens.weight
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config)
    eos = config["eos_token_id"]
    write_json(out / "generation_config.json", {"bos_token_id": config["bos_token_id"], "eos_token_id": eos, "do_sample": False})
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).resolve() != (out / name).resolve():
            shutil.copyfile(tokenizer_dir / name, out / name)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are one Parameter, counted once


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="a directory built by ops.train.corpus")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a directory with tokenizer.json")
    add_run_arguments(parser, TARGETS, out_help="the model directory to write")
    args = parser.parse_args(argv)
    recipe, device = run_recipe(TARGETS, args), pick_device(args.device)
    seed_everything(args.seed)
    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    train_tokens = token_stream(tokenizer, args.corpus, "train")
    eval_tokens = token_stream(tokenizer, args.corpus, "eval")
    config = hf_config(recipe, tokenizer, args.recipe, args.seed)
    model = build_model(config, device)
    started = time.perf_counter()
    history = train(model, recipe, train_tokens, eval_tokens, device, args.seed, args.max_seconds)
    seconds = time.perf_counter() - started
    save_checkpoint(model, config, args.tokenizer, args.out)
    figures = {
        "parameters": count_parameters(model), "train_tokens": train_tokens.numel(), "eval_tokens": eval_tokens.numel(),
        "steps_run": steps_run(history), "tokens_seen": steps_run(history) * recipe.batch_size * recipe.seq_len,
        "train_seconds": round(seconds, 1),
        "final_train_loss": history["train"][-1][1], "final_eval_loss": history["eval"][-1][1],
    }  # fmt: skip
    results = write_results(args, recipe, history, f"target ({args.recipe}, seed {args.seed})", figures, history)
    print(f"target {args.recipe} seed {args.seed}: {results['parameters']:,} params, {results['steps_run']} of "
          f"{recipe.steps} steps, {seconds:.0f} s, "
          f"train loss {results['final_train_loss']:.3f}, held-out loss {results['final_eval_loss']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
