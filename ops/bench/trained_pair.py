"""A trained DSpark pair on one GPU (issue 46, point 3): the `large` recipe trained in the call, then
its accept length on held-out code and its tok/s against plain greedy decoding at batch 1 and 16.

Weights over 10 MB stay out of the repository and the GPU machine starts bare, so one call does all:

1. `target`, `drafter`: the target, then its drafter on it (seed 0), trained by the scripts
   `ops/train/run_gpu.sh`'s `pair:RECIPE:RUN` runs, from a corpus `ops.train.corpus` built
   (`--corpus`: its train.jsonl.gz and eval.jsonl.gz). `--target-steps` / `--drafter-steps` cap a
   recipe's steps; under `--budget-s` each run also stops at the first step past its share of the
   time (`--max-seconds`: TARGET_SHARE of what is left for training to the target, the rest to the
   drafter). Either way each section's `steps_run` against `recipe_steps` says so: a capped run's
   figures are a shorter run's, not the recipe's.
2. `accept`: mean accept length on held-out prompts at T = 0 and 1, as `ops/train/evaluate.py`
   defines and draws them (`evaluate_drafter`: the model card's figures).
3. `speed`, then `speed_deterministic`: plain greedy decoding against DSpark (static verify), each
   core built as `sparkwire scheduler` builds it (`build_core`: CUDA graphs, draft graphs; no prefix
   cache, so every round does the same work) on the first `batch` held-out prompts, warmed up by one
   run, then `--rounds` runs alternating which mode goes first; tok/s of the median round over the
   decode steps until the last request ends (`gpu_core_check.time_core`; `held_tok_s`: until the
   first does). Every request's ids are compared with plain's: without `--deterministic` bf16
   rounding may part them (the share identical is reported), with it (`speed_deterministic`) they
   must be identical, and the run exits 1 if they are not.

The JSON (`--out`) is rewritten after each section, so a run cut short keeps what finished. Its
top-level `accept_length_counts` (verify passes by tokens gained, `speed`'s DSpark rows) is what
`sparkwire bench gpu-core --speedup --accept-lengths FILE` replays on the 8B shape.

    sparkwire bench trained-pair --corpus .corpus --budget-s 450 --out $OUT/trained_pair.json
    sparkwire bench trained-pair --corpus CORPUS --recipe toy --device cpu --out /tmp/pair.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from contracts.scheduler import SamplingParams
from ops.bench import scheduler_harness as harness
from ops.bench.common import REPO, deadline_sections, device_name, script, section_rows, write_json
from ops.bench.gpu_core_check import time_core
from ops.train import evaluate, train_drafter, train_target
from ops.train.recipes import DRAFTERS, TARGETS

TOKENIZER = REPO / "ops/models/sparkwire-micro"  # the one tokenizer every recipe shares (run_gpu.sh)
TARGET_SHARE = 0.7  # of the training time left, to the target: 210 s of 303 in the large recipe's one run (model card)
SETUP_S = 20  # a training script's time before its loop (the corpus tokenized, the model built)
DRAFTER_SETUP_S = 45  # the drafter's: also the target's self-distilled sequences (22 s for `large` on an H200)
MODES = ("plain", "dspark")


# ---- 1. training ----


def train_pair(args, work: Path, section, deadline: float) -> bool:
    """Target then drafter, each capped by its share of the time before the measurements' reserve."""
    common = ["--corpus", str(args.corpus), "--recipe", args.recipe, "--seed", "0", "--device", args.device]
    target = ["--tokenizer", str(args.tokenizer), *common, *_steps(args.target_steps)]
    train_s = deadline - args.measure_s - time.monotonic()
    target_s = TARGET_SHARE * train_s - SETUP_S
    section("target", lambda: _run(train_target.main, target, work / "target", target_s, TARGETS[args.recipe].steps))
    if not (work / "target/config.json").is_file():
        return False
    drafter = ["--target", str(work / "target"), *common, *_steps(args.drafter_steps)]
    train_s = deadline - args.measure_s - time.monotonic()
    drafter_s = train_s - DRAFTER_SETUP_S
    section("drafter", lambda: _run(train_drafter.main, drafter, work / "draft", drafter_s, DRAFTERS[args.recipe].steps))
    return (work / "draft/config.json").is_file()


def _steps(steps: int | None) -> list[str]:
    return [] if steps is None else ["--steps", str(steps)]


def _run(script_main, argv: list[str], out: Path, max_seconds: float, recipe_steps: int) -> dict:
    """One training script in this process; -> its results JSON's figures (history left out) and
    its steps against the recipe's own (`--steps` and `--max-seconds` both cut a run short)."""
    if max_seconds <= 0:
        raise RuntimeError(f"no time left to train {out.name} before the measurements' reserve (--measure-s)")
    results = out.parent / f"{out.name}.json"
    script_main([*argv, "--out", str(out), "--results", str(results), "--max-seconds", f"{max_seconds:.0f}"])
    figures = json.loads(results.read_text(encoding="utf-8"))
    keep = ("parameters", "train_seconds", "final_train_loss", "final_eval_loss", "distill_seconds",
            "final_eval_teacher_forced_greedy_accept", "recipe_settings")  # fmt: skip
    return {"steps_run": figures["steps_run"], "recipe_steps": recipe_steps, "max_seconds": round(max_seconds),
            "shorter_run": figures["steps_run"] < recipe_steps, **{k: figures[k] for k in keep if k in figures}}  # fmt: skip


# ---- 3. speed: plain against DSpark, greedy, the same ids expected ----


def speed_rows(target: Path, draft: Path, prompts: list[list[int]], batches, new_tokens: int, device: str, rounds: int,
               deterministic: bool = False) -> list[dict]:  # fmt: skip
    """Per batch, a plain and a DSpark row (see the module docstring, 3.): the median round's
    `time_core` figures, every round's tok/s, whether the rounds' ids agree; DSpark's row adds its
    speedup, accept length and counts over those runs, and the requests whose ids equal plain's."""
    cores = {mode: _served_core(target, draft if mode == "dspark" else None, prompts, batches, new_tokens, device, deterministic)
             for mode in MODES}  # fmt: skip
    rows = []
    for batch in batches:
        before = harness.accept_length_counts(cores["dspark"])
        for core in cores.values():  # draft graphs are captured on first use per context bucket: a full-length warm-up
            time_core(core, _requests(prompts[:batch], new_tokens, "w"))
        timed: dict[str, list[dict]] = {mode: [] for mode in MODES}
        ids: dict[str, list[list[int]]] = {mode: [] for mode in MODES}
        for round_ in range(rounds):
            for place in range(len(MODES)):
                mode, tag, out = MODES[(round_ + place) % len(MODES)], f"r{round_}-", {}
                timed[mode].append(time_core(cores[mode], _requests(prompts[:batch], new_tokens, tag), ids=out))
                ids[mode].append([out[f"{tag}{i}"] for i in range(batch)])
        counts = _minus(harness.accept_length_counts(cores["dspark"]), before)
        plain, dspark = (_row(batch, mode, deterministic, timed[mode], ids[mode]) for mode in MODES)
        rows += [plain, dspark | _against_plain(plain, dspark, ids["plain"][0], ids["dspark"][0], counts)]
    return rows


def _served_core(target, draft, prompts, batches, new_tokens: int, device: str, deterministic: bool):
    # + a verify block past the end
    longest = max(len(p) for p in prompts[: max(batches)]) + new_tokens + 2 * harness.KV_BLOCK_SIZE
    spec = {} if draft is None else {"draft_model": str(draft), "speculative_algorithm": "dspark"}
    return harness.served_core(target, device=device, max_running_requests=max(batches), prefix_caching=False,
                               num_kv_blocks=max(batches) * (-(-longest // harness.KV_BLOCK_SIZE) + 1),
                               kv_block_size=harness.KV_BLOCK_SIZE, deterministic=deterministic, **spec)  # fmt: skip


def _requests(prompts: list[list[int]], new_tokens: int, tag: str) -> list:
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [harness.new_request(f"{tag}{i}", np.asarray(p, np.int32), sampling) for i, p in enumerate(prompts)]


def _row(batch: int, mode: str, deterministic: bool, timed: list[dict], ids: list[list[list[int]]]) -> dict:
    median = sorted(timed, key=lambda r: r["tok_s"])[len(timed) // 2]
    keep = ("tok_s", "held_tok_s", "ms_per_step", "steps", "tokens")
    return {"batch": batch, "mode": mode, "deterministic": deterministic, **{k: median[k] for k in keep},
            "rounds_tok_s": [r["tok_s"] for r in timed], "rounds_same_ids": all(run == ids[0] for run in ids)}  # fmt: skip


def _against_plain(plain: dict, dspark: dict, plain_ids: list[list[int]], dspark_ids: list[list[int]], counts: list[int]) -> dict:
    """DSpark's row against plain's: speedup, accept length (tokens gained per verify pass) and the
    requests with plain's ids (first round), each differing one's first differing position."""
    same = [a == b for a, b in zip(plain_ids, dspark_ids, strict=True)]
    first_difference = [next((j for j, (a, b) in enumerate(zip(p, d)) if a != b), min(len(p), len(d)))
                        for p, d, equal in zip(plain_ids, dspark_ids, same) if not equal]  # fmt: skip
    passes = sum(counts)
    return {"speedup": dspark["tok_s"] / plain["tok_s"] if plain["tok_s"] else None,
            "accept_len": sum(n * c for n, c in enumerate(counts)) / passes if passes else None,
            "accept_length_counts": counts, "same_tokens_as_plain": sum(same) / len(same), "identical": all(same),
            "first_difference": first_difference}  # fmt: skip


def _minus(after: list[int], before: list[int]) -> list[int]:
    before = before + [0] * (len(after) - len(before))
    return [a - b for a, b in zip(after, before)]


# ---- the run ----


def measure(args, work: Path, section) -> None:
    target, draft = work / "target", work / "draft"
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    device = torch.device(args.device)
    section("accept", lambda: evaluate.evaluate_drafter(target, draft, args.corpus, device, num_prompts=args.num_prompts,
                                                       new_tokens=args.new_tokens))  # fmt: skip
    prompts = evaluate.held_out_prompts(tokenizer, args.corpus, max(args.batches), evaluate.PROMPT_LEN, seed=0)
    for name, deterministic in (("speed", False), ("speed_deterministic", True)):
        section(name, lambda d=deterministic: speed_rows(target, draft, prompts, args.batches, args.new_tokens, args.device,
                                                         args.rounds, d))  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    deadline = time.monotonic() + args.budget_s
    work = args.work or Path(tempfile.mkdtemp(prefix="sparkwire-trained-pair-"))
    result: dict = {"device": device_name(args.device), "torch": torch.__version__, "recipe": args.recipe, "work": str(work),
                    "prompt_len": evaluate.PROMPT_LEN, "new_tokens": args.new_tokens, "batches": args.batches}  # fmt: skip
    in_time = deadline_sections(result, deadline)

    def section(name: str, fn):  # each section on disk as it ends: a run cut short keeps what finished
        value = in_time(name, fn)
        write_json(args.out, result)
        return value

    if train_pair(args, work, section, deadline):
        measure(args, work, section)
    rows = [row for row in section_rows(result, "speed") if row["mode"] == "dspark"]
    if rows:  # what `gpu-core --speedup --accept-lengths` replays
        result["accept_length_counts"] = [sum(column) for column in zip(*(row["accept_length_counts"] for row in rows))]
    result["elapsed_s"] = round(args.budget_s - (deadline - time.monotonic()), 1)
    write_json(args.out, result)
    return result


def table(result: dict) -> str:
    lines = [f"{result['recipe']} pair on {result['device']}, {result['elapsed_s']} s"]
    for name in ("target", "drafter"):
        figures = result.get(name, {})
        if "steps_run" in figures:
            shorter = " (SHORTER than the recipe)" if figures["shorter_run"] else ""
            lines.append(f"{name}: {figures['steps_run']} of {figures['recipe_steps']} steps{shorter}, {figures['train_seconds']} s, "
                         f"held-out loss {figures['final_eval_loss']:.3f}")  # fmt: skip
        elif figures:
            lines.append(f"{name}: {next(iter(figures.values()))[-300:]}")
    accept = result.get("accept", {})
    for temperature in ("0", "1"):
        if f"temperature_{temperature}" in accept:
            figures = accept[f"temperature_{temperature}"]
            lines.append(f"accept length on held-out code, T = {temperature}: {figures['mean_accept_length']:.2f} "
                         f"(gamma {figures['gamma']}, {figures['verify_forwards']} verify forwards)")  # fmt: skip
    lines += ["| deterministic | batch | plain tok/s | DSpark tok/s | x plain | accept | same ids as plain |", "|---|---|---|---|---|---|---|"]
    for name in ("speed", "speed_deterministic"):
        rows = section_rows(result, name)
        for plain, dspark in zip(rows[0::2], rows[1::2]):
            accept_len = "n/a" if dspark["accept_len"] is None else f"{dspark['accept_len']:.2f}"
            speedup = "n/a" if dspark["speedup"] is None else f"{dspark['speedup']:.2f}"
            lines.append(f"| {dspark['deterministic']} | {dspark['batch']} | {plain['tok_s']:.0f} | {dspark['tok_s']:.0f} | {speedup} | "
                         f"{accept_len} | {dspark['same_tokens_as_plain']:.0%} |")  # fmt: skip
        if not rows and name in result:
            lines.append(f"{name}: {str(result[name])[-300:]}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", type=Path, required=True, help="a corpus built by ops.train.corpus (train/eval.jsonl.gz)")
    parser.add_argument("--recipe", default="large", help="ops/train/recipes.py's target and drafter recipe")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    parser.add_argument("--target-steps", type=int, default=None, help="cap the target recipe's steps (a shorter run, recorded)")
    parser.add_argument("--drafter-steps", type=int, default=None, help="cap the drafter recipe's steps (a shorter run, recorded)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda; cpu for the smoke run")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--num-prompts", type=int, default=evaluate.NUM_PROMPTS, help="held-out prompts for the accept length")
    parser.add_argument("--new-tokens", type=int, default=evaluate.NEW_TOKENS)
    parser.add_argument("--rounds", type=int, default=5, help="timed runs of each mode (the median kept)")
    parser.add_argument("--budget-s", type=float, default=500,
                        help="the whole run's seconds: training stops at its share, sections not started by then are skipped")
    parser.add_argument("--measure-s", type=float, default=100, help="seconds of --budget-s kept for the measurements")
    parser.add_argument("--work", type=Path, default=None, help="where the pair is written (default: a new temporary folder)")
    parser.add_argument("--out", type=Path, required=True)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(table(result))
    deterministic = [row for row in section_rows(result, "speed_deterministic") if row["mode"] == "dspark"]
    if any(not row["identical"] for row in deterministic):
        print("FAILED: with --deterministic DSpark's greedy ids differ from plain's")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
