"""`sparkwire bench gpu-prefix-cache`: automatic prefix caching through the whole stack on one
GPU, cache on against cache off in one run, and the running limit sized from memory.

`sparkwire up --device cuda --load-format dummy` on a shape (default Qwen3-0.6B), once with the
prefix cache (its default) and once with `--no-prefix-caching`; each stack runs:
- `shared_prefix`: SGLang's generated-shared-prefix workload (`serve --dataset
  generated-shared-prefix`): 64 groups x 16 requests, a 2,048-token system prompt per group, a
  128-token question, 128 output tokens, concurrency 64. Bar (issue 44): output tok/s >= 3x and
  TTFT p50 <= 0.25x the cache-off figures.
- `multi_turn`: 32 conversations of 6 turns (256-token messages, 128-token answers), a turn sent
  once the one before is answered: TTFT p50 per turn, flat in the conversation's length with the cache.
- `concurrency` (the cache-on stack, its default `--max-running-requests`): random 128/128 prompts
  at concurrency 64 and 256. Bar: 256 gives >= 1.5x the output tok/s of 64.
A scenario that would start after `--budget-s` is skipped (recorded so).

    sparkwire bench gpu-prefix-cache --out $OUT/gpu_prefix_cache.json
    sparkwire bench gpu-prefix-cache --model-config ops/model_configs/Qwen3-8B --scenarios shared_prefix --groups 32 --out ...
    sparkwire bench gpu-prefix-cache --device cpu --tiny --out /tmp/prefix.json  # CPU smoke (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.bench.common import REPO, script
from ops.bench.gpu_serve_check import serving_model_dir
from ops.bench.serve import ServeConfig, run_serve_benchmark
from ops.bench.serve_launch import launched_stack, prefix_cache_counters, scheduler_metrics_url
from ops.bench.serve_workload import multi_turn_prompts, token_pool
from services.common.nats_server import free_port
from services.models import BUNDLED_MODEL


@dataclass(frozen=True)
class PrefixCheck:
    model_config: Path = REPO / "ops/model_configs/Qwen3-0.6B"
    device: str = "cuda"
    groups: int = 64
    per_group: int = 16
    system_len: int = 2048
    question_len: int = 128
    output_len: int = 128
    concurrency: int = 64
    conversations: int = 32
    turns: int = 6
    turn_len: int = 256
    answer_len: int = 128
    wide_concurrency: int = 256
    random_prompts: int = 1024  # per concurrency level of `concurrency`
    random_len: int = 128
    budget_s: float = 270.0
    up_args: tuple[str, ...] = ()
    scenarios: tuple[str, ...] = ("shared_prefix", "multi_turn", "concurrency")  # `concurrency`: the cache-on stack only

    @classmethod
    def tiny(cls, **overrides: Any) -> PrefixCheck:
        """A CPU-sized run of every scenario (the bundled model's shape)."""
        sizes = dict(model_config=BUNDLED_MODEL, device="cpu", groups=3, per_group=3, system_len=48, question_len=8,
                     output_len=4, concurrency=4, conversations=2, turns=3, turn_len=16, answer_len=4, wide_concurrency=8,
                     random_prompts=8, random_len=8, budget_s=240.0)  # fmt: skip
        return cls(**{**sizes, **overrides})


def run(check: PrefixCheck, out: Path) -> dict[str, Any]:
    began = time.monotonic()
    result: dict[str, Any] = {"check": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(check).items()}}
    with tempfile.TemporaryDirectory(prefix="sparkwire-prefix-") as tmp:
        model_dir = serving_model_dir(check.model_config, Path(tmp) / "model")
        for cache in ("on", "off"):
            if time.monotonic() - began > check.budget_s:
                result[cache] = {"scenarios": {}, "skipped": f"past --budget-s {check.budget_s:.0f}"}
                continue
            flags = () if cache == "on" else ("--no-prefix-caching",)
            log = out.with_name(f"{out.stem}_{cache}_up.log")
            result[cache] = run_stack(check, model_dir, flags, log, began, wide=cache == "on")
    result["summary"] = summary(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result


def run_stack(check: PrefixCheck, model_dir: Path, flags: tuple[str, ...], log: Path, began: float, wide: bool) -> dict[str, Any]:
    up_args = ("--device", check.device, "--load-format", "dummy", "--model", str(model_dir), *flags, *check.up_args)
    base_url = f"http://127.0.0.1:{free_port()}"
    scenarios: dict[str, Any] = {}
    cached: dict[str, dict[str, float]] = {}  # scenario -> prompt tokens found in KV (hits) of all (queries)
    with launched_stack(up_args, base_url, log) as stack:
        metrics_url = scheduler_metrics_url(stack)
        serve(base_url, check, num_prompts=check.concurrency, input_len=check.random_len, seed=99)  # warm-up (prompts of its own)
        for name in (n for n in check.scenarios if wide or n != "concurrency"):
            if time.monotonic() - began > check.budget_s:
                scenarios[name] = {"skipped": f"past --budget-s {check.budget_s:.0f}"}
                continue
            before = prefix_cache_counters(metrics_url)
            scenarios[name] = SCENARIOS[name](base_url, check, log.parent)
            cached[name] = {k: v - before[k] for k, v in prefix_cache_counters(metrics_url).items()}
    return {"ready_s": stack.ready_s, "up_exit_code": stack.exit_code, "scenarios": scenarios, "prefix_cache": cached}


def serve(base_url: str, check: PrefixCheck, **settings: Any) -> dict[str, Any]:
    settings = {"output_len": check.output_len, "max_concurrency": check.concurrency, **settings}
    config = ServeConfig(base_url=base_url, ignore_eos=True, progress=False, vocab_from=BUNDLED_MODEL, **settings)
    figures = run_serve_benchmark(config)
    figures.pop("requests", None)
    return figures


def shared_prefix(base_url: str, check: PrefixCheck, _work: Path) -> dict[str, Any]:
    return serve(base_url, check, dataset="generated-shared-prefix", gsp_num_groups=check.groups,
                 gsp_prompts_per_group=check.per_group, gsp_system_prompt_len=check.system_len,
                 gsp_question_len=check.question_len, num_prompts=check.groups * check.per_group)  # fmt: skip


def multi_turn(base_url: str, check: PrefixCheck, work: Path) -> dict[str, Any]:
    turns = multi_turn_prompts(check.conversations, check.turns, check.turn_len, check.answer_len, token_pool(BUNDLED_MODEL), seed=1)
    rows = []
    for index, prompts in enumerate(turns):
        path = work / f"multi_turn_{index}.jsonl"
        path.write_text("".join(json.dumps({"input_ids": list(p.input_ids), "output_len": p.output_len}) + "\n" for p in prompts))
        figures = serve(base_url, check, dataset_path=path, num_prompts=len(prompts), max_concurrency=len(prompts))
        rows.append({"turn": index, "prompt_len": len(prompts[0].input_ids), "ttft_p50_ms": figures["ttft_ms"]["p50"],
                     "completed": figures["completed"], "failed": figures["failed"]})  # fmt: skip
    return {"turns": rows}


def concurrency(base_url: str, check: PrefixCheck, _work: Path) -> dict[str, Any]:
    # prompts of its own per level: the cache would hold the first level's for the second
    return {str(level): serve(base_url, check, num_prompts=check.random_prompts, input_len=check.random_len, max_concurrency=level,
                              seed=level) for level in (check.concurrency, check.wide_concurrency)}  # fmt: skip


SCENARIOS = {"shared_prefix": shared_prefix, "multi_turn": multi_turn, "concurrency": concurrency}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's ratios, where both sides ran."""
    on, off = (result[c]["scenarios"].get("shared_prefix", {}) for c in ("on", "off"))
    figures: dict[str, Any] = {}
    if "output_throughput" in on and "output_throughput" in off:
        figures["shared_prefix_tok_s_on_over_off"] = on["output_throughput"] / off["output_throughput"]
        figures["shared_prefix_ttft_p50_on_over_off"] = on["ttft_ms"]["p50"] / off["ttft_ms"]["p50"]
    turns = result["on"]["scenarios"].get("multi_turn", {}).get("turns")
    if turns:
        figures["multi_turn_ttft_last_over_first"] = turns[-1]["ttft_p50_ms"] / turns[0]["ttft_p50_ms"]
    levels = result["on"]["scenarios"].get("concurrency", {})
    if len(levels) == 2:
        low, high = (levels[k]["output_throughput"] for k in levels)
        figures["wide_over_narrow_tok_s"] = high / low
    return figures


def table(result: dict[str, Any]) -> str:
    lines = ["| scenario | cache | done / failed | out tok/s | TTFT p50 ms | TTFT p99 ms |", "|---|---|---|---|---|---|"]
    for cache in ("on", "off"):
        for name, figures in result[cache]["scenarios"].items():
            rows = figures.items() if name == "concurrency" else [(name, figures)]
            for label, row in rows:
                label = f"concurrency {label}" if name == "concurrency" else label
                if "output_throughput" in row:
                    lines.append(f"| {label} | {cache} | {row['completed']} / {row['failed']} | {row['output_throughput']:.0f} | "
                                 f"{row['ttft_ms']['p50']:.1f} | {row['ttft_ms']['p99']:.1f} |")  # fmt: skip
                elif "turns" in row:
                    ttfts = " ".join(f"{t['ttft_p50_ms']:.0f}" for t in row["turns"])
                    lines.append(f"| multi_turn (TTFT p50 by turn: {ttfts}) | {cache} | | | | |")
                else:
                    lines.append(f"| {label} | {cache} | {row.get('skipped', '?')} | | | |")
    for cache in ("on", "off"):
        counted = result[cache].get("prefix_cache", {}).items()
        lines += [f"{name} ({cache}): {c['hits']:.0f} of {c['queries']:.0f} prompt tokens cached" for name, c in counted]
    lines += [f"{name}: {value:.2f}" for name, value in result["summary"].items()]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = PrefixCheck()
    parser.add_argument("--model-config", type=Path, default=defaults.model_config, help="a shape directory (config.json)")
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke sizes (the bundled model; other flags still apply)")
    for name in ("groups", "per_group", "system_len", "question_len", "output_len", "concurrency", "conversations", "turns",
                 "turn_len", "answer_len", "wide_concurrency", "random_prompts", "random_len"):  # fmt: skip
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=None, help=f"skip scenarios that would start later (default {defaults.budget_s:.0f})")
    parser.add_argument("--up-args", default="", help="more `sparkwire up` flags for both stacks")
    parser.add_argument("--scenarios", nargs="+", choices=tuple(SCENARIOS), default=None, help="which to run (default all)")
    parser.add_argument("--out", type=Path, default=Path("gpu_prefix_cache.json"), help="the JSON (figures go to results/gpu_serve.md)")


def main(args: argparse.Namespace) -> int:
    import shlex

    names = [f.name for f in dataclasses.fields(PrefixCheck) if f.name not in ("model_config", "device", "up_args", "scenarios")]
    overrides = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    overrides["up_args"] = tuple(shlex.split(args.up_args))
    if args.scenarios:
        overrides["scenarios"] = tuple(args.scenarios)
    if args.tiny:
        check = PrefixCheck.tiny(**overrides, **({"device": args.device} if args.device != "cuda" else {}))
    else:
        check = PrefixCheck(model_config=args.model_config, device=args.device, **overrides)
    result = run(check, args.out)
    failed = sum(f.get("failed", 0) for c in ("on", "off") for f in result[c]["scenarios"].values() if isinstance(f, dict))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
