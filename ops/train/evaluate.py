"""Held-out evaluation of the bundled pair (the figures in the model card).

    python -m ops.train.evaluate --corpus /tmp/corpus --model ops/models/sparkwire-micro \
        --draft ops/models/sparkwire-micro-dspark --out eval.json

Target: perplexity and bits per byte on the held-out files, against the same files with each
file's tokens shuffled (same tokens, same counts, no order: a model that learnt structure scores
far better on the real files). The held-out stream is cut into non-overlapping windows of the
recipe's training length; every token after a window's first is scored.

Drafter: mean accept length through the serving stack itself (`SchedulerCore` with the
`DSparkProposer`, static verify of gamma = 7 drafts), over NUM_PROMPTS held-out prompts of
PROMPT_LEN tokens continued for NEW_TOKENS tokens, at temperature 0 and 1. Accept length is tokens
gained per verify forward (accepted drafts + the bonus token; 1.0 = no draft ever accepted,
gamma + 1 = all): sum over requests of (completion tokens - 1) / sum of `spec_verify_ct` (the
first token comes from the prefill forward, which verifies nothing).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from contracts.scheduler import SamplingParams

from ops.train.common import encode_documents, environment, load_hf_target, pick_device, write_json
from ops.train.corpus import read_split
from ops.train.recipes import TARGETS
from ops.train.tokenizer import END_OF_TEXT
from services.scheduler.build import core_for
from services.scheduler.core import SchedulerCore
from services.scheduler.model.loader import load_model_runner
from services.scheduler.request import SchedulerRequest
from services.scheduler.spec.dspark_loader import load_dspark_proposer
from services.tokenizer.text_model import TextModel

DEFAULT_WINDOW = 512
SAMPLE_PROMPT = "def fibonacci(n):"
NUM_PROMPTS, PROMPT_LEN, NEW_TOKENS = 32, 64, 128
TEMPERATURES = (0.0, 1.0)
MAX_STEPS = 10_000


def held_out_streams(tokenizer: Tokenizer, corpus_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """{"real": held-out docs + END_OF_TEXT each, "shuffled": each doc's tokens permuted}."""
    eot = tokenizer.token_to_id(END_OF_TEXT)
    docs = encode_documents(tokenizer, [text for _, text in read_split(corpus_dir, "eval")])
    generator = torch.Generator().manual_seed(seed)
    real = [torch.tensor([*doc, eot]) for doc in docs]
    shuffled = [torch.cat((doc[torch.randperm(doc.numel() - 1, generator=generator)], doc[-1:])) for doc in real]
    return {"real": torch.cat(real), "shuffled": torch.cat(shuffled)}


@torch.no_grad()
def score_stream(model: torch.nn.Module, stream: torch.Tensor, token_bytes: torch.Tensor, window: int, device) -> dict:
    """Perplexity and bits per byte of the scored tokens (all but each window's first)."""
    count = stream.numel() // window
    windows = stream[: count * window].view(count, window)
    nll, tokens, num_bytes = 0.0, 0, 0
    for chunk in windows.split(8):
        chunk = chunk.to(device)
        logits = model(input_ids=chunk).logits.float()  # [b, S, V]
        targets = chunk[:, 1:]
        nll += float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum"))
        tokens += targets.numel()
        num_bytes += int(token_bytes[targets.cpu()].sum())
    return {"tokens": tokens, "bytes": num_bytes, "loss": nll / tokens, "perplexity": math.exp(nll / tokens),
            "bits_per_byte": nll / math.log(2) / num_bytes}  # fmt: skip


@torch.no_grad()
def greedy_text(model: torch.nn.Module, tokenizer: Tokenizer, prompt: str, num_new: int, device) -> str:
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids], device=device)
    out = model.generate(ids, max_new_tokens=num_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=False)


def evaluate_target(model_dir: Path, corpus_dir: Path, device: torch.device, seed: int = 0) -> dict:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    recipe = TARGETS.get(config.get("sparkwire_recipe", ""))
    window = recipe.seq_len if recipe is not None else DEFAULT_WINDOW
    token_bytes = torch.tensor([len(b) for b in TextModel.from_dir(model_dir).token_bytes])
    model = load_hf_target(model_dir, device)
    streams = held_out_streams(tokenizer, corpus_dir, seed)
    scores = {name: score_stream(model, stream, token_bytes, window, device) for name, stream in streams.items()}
    return {"window": window, "held_out": scores["real"], "shuffled": scores["shuffled"],
            "sample": {"prompt": SAMPLE_PROMPT, "greedy": greedy_text(model, tokenizer, SAMPLE_PROMPT, 64, device)}}  # fmt: skip


def held_out_prompts(tokenizer: Tokenizer, corpus_dir: Path, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` windows of `length` tokens at seeded random offsets of the held-out stream."""
    stream = held_out_streams(tokenizer, corpus_dir, seed)["real"]
    starts = torch.randint(0, stream.numel() - length, (count,), generator=torch.Generator().manual_seed(seed))
    return [stream[start : start + length].tolist() for start in starts.tolist()]


def run_speculative(core: SchedulerCore, prompts: list[list[int]], temperature: float, num_new: int) -> dict:
    """Serve every prompt through the core at once; -> per-request output ids and verify counts."""
    for index, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=num_new, temperature=temperature, seed=index, ignore_eos=True)
        core.add(SchedulerRequest(f"p{index}", np.asarray(prompt, np.int32), "eval", params))
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    verify: dict[str, int] = {}
    for _ in range(MAX_STEPS):
        if not core.has_work():
            short = {rid: len(ids) for rid, ids in tokens.items() if len(ids) != num_new}
            if short:  # an aborted request (say, an empty prompt) would bias the figures silently
                raise RuntimeError(f"requests finished with fewer than {num_new} tokens: {short}")
            return {"tokens": tokens, "verify": verify}
        for output in core.step():
            tokens[output.rid] += output.new_token_ids
            verify[output.rid] = output.spec_verify_ct or 0
    raise RuntimeError(f"the core did not finish {len(prompts)} requests in {MAX_STEPS} steps")


def mean_accept_length(out: dict) -> tuple[float, int, int]:
    """`run_speculative`'s output -> (mean accept length, verify forwards, tokens after each first)."""
    gained = sum(len(ids) - 1 for ids in out["tokens"].values())
    forwards = sum(out["verify"].values())
    return gained / forwards, forwards, gained


def evaluate_drafter(
    model_dir: Path, draft_dir: Path, corpus_dir: Path, device: torch.device, seed: int = 0,
    num_prompts: int = NUM_PROMPTS, new_tokens: int = NEW_TOKENS,
) -> dict:  # fmt: skip
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = held_out_prompts(tokenizer, corpus_dir, num_prompts, PROMPT_LEN, seed)
    return accept_lengths(model_dir, draft_dir, prompts, device, new_tokens, seed)


def accept_lengths(model_dir: Path, draft_dir: Path, prompts: list[list[int]], device, new_tokens: int, seed: int = 0) -> dict:
    """Mean accept length at each of TEMPERATURES, the pair served by a SchedulerCore (see the module docstring)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the serving defaults
    longest = max(len(prompt) for prompt in prompts) + new_tokens + 16  # + a verify block past the end
    blocks_needed = len(prompts) * (-(-longest // 16) + 1)
    results = {"dtype": str(dtype).removeprefix("torch."), "num_prompts": len(prompts), "prompt_len": longest - new_tokens - 16,
               "new_tokens": new_tokens}  # fmt: skip
    for temperature in TEMPERATURES:
        runner = load_model_runner(model_dir, device=device, dtype=dtype, num_kv_blocks=blocks_needed, kv_block_size=16)
        proposer = load_dspark_proposer(draft_dir, runner)
        core = core_for(runner, max_running_requests=len(prompts), chunked_prefill_size=4096, proposer=proposer, seed=seed)
        accept, forwards, gained = mean_accept_length(run_speculative(core, prompts, temperature, new_tokens))
        results[f"temperature_{temperature:g}"] = {
            "gamma": proposer.num_draft_tokens, "mean_accept_length": accept, "verify_forwards": forwards,
            "tokens_after_first": gained,
        }  # fmt: skip
    return results


def print_target(figures: dict) -> None:
    real, shuffled = figures["held_out"], figures["shuffled"]
    print(f"target held-out: ppl {real['perplexity']:.2f}, {real['bits_per_byte']:.3f} bits/byte; "
          f"shuffled: ppl {shuffled['perplexity']:.2f}, {shuffled['bits_per_byte']:.3f} bits/byte")  # fmt: skip
    print(f"greedy after {SAMPLE_PROMPT!r}: {figures['sample']['greedy']!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True, help="the target model directory")
    parser.add_argument("--draft", type=Path, default=None, help="the DSpark draft directory (accept lengths)")
    parser.add_argument("--no-target", action="store_true", help="skip the target's perplexity figures")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--out", type=Path, required=True, help="results JSON")
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    results: dict = {"environment": environment()}
    if not args.no_target:
        results["target"] = evaluate_target(args.model, args.corpus, device)
    if args.draft is not None:
        results["drafter"] = evaluate_drafter(args.model, args.draft, args.corpus, device)
    write_json(args.out, results)
    if not args.no_target:
        print_target(results["target"])
    for temperature in TEMPERATURES if args.draft is not None else ():
        figures = results["drafter"][f"temperature_{temperature:g}"]
        print(f"drafter at temperature {temperature:g}, gamma {figures['gamma']}: mean accept length "
              f"{figures['mean_accept_length']:.2f} ({figures['verify_forwards']} verify forwards)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
