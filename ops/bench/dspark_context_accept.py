"""The bundled DSpark pair's accept length by prompt length and the drafter's context window.

The bundled drafter (ops/models/sparkwire-micro-dspark) was trained on sequences of 256 tokens: no
anchor it met sat more than 256 positions after its context's start. Served on a longer prompt with
the whole context in view, its blocks attend to positions it never saw that far back, and its
drafts get worse; with `--draft-context-window` (the config's `sparkwire_context_window`, 256 for
it) each block sees only the last window of context before its anchor, as in training.

Prompts: the first tokens of the repository's own Python files (services/, sorted, those long
enough), so the figures need no corpus and repeat anywhere. Each (prompt length, window,
temperature) serves --num-prompts prompts at once through the core `build_core` makes for
`--speculative-algorithm dspark` (fp32 on the CPU; bf16 and draft graphs on CUDA; static verify of
gamma = 7), each continued for --new-tokens tokens; `output_tok_s` their tokens over the run's
wall time; accept length = tokens gained per verify forward (accepted drafts + the bonus token),
as `ops/train/evaluate.py` counts it; `propose_ms` (CPU only) the median wall time of one
`propose` (all the batch's blocks): a window that binds reads W / 16 + 1 cache blocks a row
instead of the whole context.
Windows: 0 is the whole context; "config" the draft config's.

    sparkwire bench dspark-accept --prompt-lens 64 256 512 1024 2048 --out ops/bench/results/dspark_context_accept.json
    sparkwire bench dspark-accept --device cuda --out $OUT/dspark_context_accept_gpu.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ops.bench import scheduler_harness as harness
from ops.bench.common import REPO, RESULTS, device_name, script, write_json
from ops.train.evaluate import mean_accept_length, run_speculative
from services.models import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL
from services.scheduler.spec.dspark_config import DSparkConfig

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


def accept_length(args: argparse.Namespace, prompts: list[list[int]], window: int | None, temperature: float) -> dict:
    """The pair served as `sparkwire up --speculative-algorithm dspark` serves it (`build_core`: on CUDA
    with draft graphs), every prompt at once."""
    longest = max(len(prompt) for prompt in prompts) + args.new_tokens + KV_BLOCK_SIZE  # + a verify block past the end
    core = harness.served_core(args.model, device=args.device, draft_model=str(args.draft), speculative_algorithm="dspark",
                               draft_context_window=window, max_running_requests=len(prompts),
                               num_kv_blocks=len(prompts) * (-(-longest // KV_BLOCK_SIZE) + 1), kv_block_size=KV_BLOCK_SIZE)  # fmt: skip
    proposer = harness.proposer_of(core)
    served_window = getattr(proposer, "proposer", proposer).context_window  # DraftGraphs wraps the DSparkProposer
    propose, drafting = proposer.propose, []

    def timed(request):
        started = time.perf_counter()
        try:
            return propose(request)
        finally:
            drafting.append(time.perf_counter() - started)

    proposer.propose = timed
    started = time.perf_counter()
    accept, forwards, _ = mean_accept_length(run_speculative(core, prompts, temperature, args.new_tokens))
    seconds = time.perf_counter() - started
    on_cpu = harness.runner_of(core).device.type == "cpu"  # elsewhere a propose's host time is its launch, not its work
    return {"accept_length": round(accept, 3), "verify_forwards": forwards, "window_served": served_window,
            "propose_ms": round(1e3 * sorted(drafting)[len(drafting) // 2], 3) if on_cpu else None, "proposes": len(drafting),
            "output_tok_s": round(len(prompts) * args.new_tokens / seconds, 1)}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    rows: list[dict] = []
    result = {"model": _shown(args.model), "draft": _shown(args.draft), "configured_window": DSparkConfig.from_pretrained(args.draft).context_window,
              "num_prompts": args.num_prompts, "new_tokens": args.new_tokens,
              "device": device_name(args.device), "torch": torch.__version__,
              "rows": rows}  # fmt: skip
    for length in args.prompt_lens:
        prompts = repository_prompts(tokenizer, args.num_prompts, length)
        for temperature in args.temperatures:
            for window in args.windows:
                started = time.perf_counter()
                figures = accept_length(args, prompts, None if window == "config" else int(window), temperature)
                rows.append({"prompt_len": length, "temperature": temperature, "window": window, **figures,
                             "seconds": round(time.perf_counter() - started, 2)})  # fmt: skip
                write_json(args.out, result)  # each row kept as it comes
                print(f"prompt {length:5d}  T={temperature:g}  window {window!s:>6}: accept {figures['accept_length']:.3f}, "
                      f"propose {figures['propose_ms']} ms, {figures['output_tok_s']} tok/s", flush=True)  # fmt: skip
    print(table(result))
    return result


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


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
    for figure, title in (("propose_ms", "propose ms (median, all the batch's blocks; CPU only)"), ("output_tok_s", "output tok/s")):
        lines += ["", f"{title}, T = 0:", "", "| prompt tokens | " + " | ".join(f"window {w}" for w in windows) + " |",
                  "|---|" + "---|" * len(windows)]  # fmt: skip
        for length in dict.fromkeys(row["prompt_len"] for row in result["rows"]):
            cells = {row["window"]: row[figure] for row in result["rows"] if row["prompt_len"] == length and row["temperature"] == 0}
            lines.append(f"| {length} | " + " | ".join(f"{cells.get(w, '')}" for w in windows) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    parser.add_argument("--draft", type=Path, default=BUNDLED_DRAFT_MODEL)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 256, 512, 1024])
    parser.add_argument("--windows", nargs="+", default=["0", "config", "128", "512"], help='context windows: ints (0: all) or "config"')
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "dspark_context_accept.json")


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
