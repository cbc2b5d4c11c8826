"""The bundled DSpark pair's accept length by prompt length and the drafter's context window, on the CPU.

The bundled drafter (ops/models/sparkwire-micro-dspark) was trained on sequences of 256 tokens: no
anchor it met sat more than 256 positions after its context's start. Served on a longer prompt with
the whole context in view, its blocks attend to positions it never saw that far back, and its
drafts get worse; with `--draft-context-window` (the config's `sparkwire_context_window`, 256 for
it) each block sees only the last window of context before its anchor, as in training.

Prompts: the first tokens of the repository's own Python files (services/, sorted, those long
enough), so the figures need no corpus and repeat anywhere. Each (prompt length, window,
temperature) serves --num-prompts prompts at once through `SchedulerCore` with the bundled pair
(fp32, static verify of gamma = 7), each continued for --new-tokens tokens; accept length = tokens
gained per verify forward (accepted drafts + the bonus token), as `ops/train/evaluate.py` counts it;
`propose_ms` the median wall time of one `propose` (all the batch's blocks) on this CPU: a window
that binds reads W / 16 + 1 cache blocks a row instead of the whole context.
Windows: 0 is the whole context; "config" the draft config's.

    python -m ops.bench.dspark_context_accept --out ops/bench/results/dspark_context_accept.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ops.train.evaluate import run_speculative
from services.models import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL
from services.scheduler.core import SchedulerCore
from services.scheduler.model.loader import load_model_runner
from services.scheduler.spec.dspark_config import DSparkConfig
from services.scheduler.spec.dspark_loader import load_dspark_proposer

REPO = Path(__file__).resolve().parents[2]
KV_BLOCK_SIZE = 16


def repository_prompts(tokenizer: Tokenizer, count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `count` Python files under services/ holding that many."""
    prompts = []
    for path in sorted((REPO / "services").rglob("*.py")):
        ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} files under services/ hold {length} tokens; asked for {count}")


def accept_length(model: Path, draft: Path, prompts: list[list[int]], window: int, temperature: float, new_tokens: int) -> dict:
    longest = max(len(prompt) for prompt in prompts) + new_tokens + KV_BLOCK_SIZE  # + a verify block past the end
    num_blocks = len(prompts) * (-(-longest // KV_BLOCK_SIZE) + 1)
    runner = load_model_runner(model, device=torch.device("cpu"), dtype=torch.float32, num_kv_blocks=num_blocks, kv_block_size=KV_BLOCK_SIZE)
    proposer = load_dspark_proposer(draft, runner, context_window=window)
    propose, drafting = proposer.propose, []

    def timed(request):
        started = time.perf_counter()
        try:
            return propose(request)
        finally:
            drafting.append(time.perf_counter() - started)

    proposer.propose = timed
    core = SchedulerCore(runner, max_running_requests=len(prompts), chunked_prefill_size=4096, proposer=proposer, seed=0)
    out = run_speculative(core, prompts, temperature, new_tokens)
    gained = sum(len(ids) - 1 for ids in out["tokens"].values())
    forwards = sum(out["verify"].values())
    return {"accept_length": round(gained / forwards, 3), "verify_forwards": forwards, "window_served": proposer.context_window,
            "propose_ms": round(1e3 * sorted(drafting)[len(drafting) // 2], 3), "proposes": len(drafting)}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    configured = DSparkConfig.from_pretrained(args.draft).context_window
    rows = []
    for length in args.prompt_lens:
        prompts = repository_prompts(tokenizer, args.num_prompts, length)
        for temperature in args.temperatures:
            for window in args.windows:
                started = time.perf_counter()
                served = None if window == "config" else int(window)
                figures = accept_length(args.model, args.draft, prompts, served, temperature, args.new_tokens)
                rows.append({"prompt_len": length, "temperature": temperature, "window": window, **figures,
                             "seconds": round(time.perf_counter() - started, 2)})  # fmt: skip
                print(f"prompt {length:5d}  T={temperature:g}  window {window!s:>6}: accept {figures['accept_length']:.3f}, "
                      f"propose {figures['propose_ms']:.2f} ms", flush=True)  # fmt: skip
    result = {"model": str(args.model.relative_to(REPO)) if args.model.is_relative_to(REPO) else str(args.model),
              "draft": str(args.draft.relative_to(REPO)) if args.draft.is_relative_to(REPO) else str(args.draft),
              "configured_window": configured, "num_prompts": args.num_prompts, "new_tokens": args.new_tokens,
              "torch": torch.__version__, "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(table(result))
    return result


def table(result: dict) -> str:
    windows = list(dict.fromkeys(row["window"] for row in result["rows"]))
    lines = [f"accept length (gamma 7; {result['num_prompts']} prompts x {result['new_tokens']} new tokens; the draft config's window: "
             f"{result['configured_window']})", "",
             "| prompt tokens | T | " + " | ".join(f"window {w}" + (" (whole context)" if w == "0" else "") for w in windows) + " |",
             "|---|---|" + "---|" * len(windows)]  # fmt: skip
    cells: dict[tuple, dict] = {}
    for row in result["rows"]:
        cells.setdefault((row["prompt_len"], row["temperature"]), {})[row["window"]] = row["accept_length"]
    for (length, temperature), by_window in cells.items():
        lines.append(f"| {length} | {temperature:g} | " + " | ".join(f"{by_window.get(w, '')}" for w in windows) + " |")
    lines += ["", "propose ms (median, all the batch's blocks), T = 0:", "",
              "| prompt tokens | " + " | ".join(f"window {w}" for w in windows) + " |", "|---|" + "---|" * len(windows)]  # fmt: skip
    for length in dict.fromkeys(row["prompt_len"] for row in result["rows"]):
        ms = {row["window"]: row["propose_ms"] for row in result["rows"] if row["prompt_len"] == length and row["temperature"] == 0}
        lines.append(f"| {length} | " + " | ".join(f"{ms.get(w, '')}" for w in windows) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    parser.add_argument("--draft", type=Path, default=BUNDLED_DRAFT_MODEL)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 256, 512, 1024])
    parser.add_argument("--windows", nargs="+", default=["0", "config", "128", "512"], help='context windows: ints (0: all) or "config"')
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "ops/bench/results/dspark_context_accept.json")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
