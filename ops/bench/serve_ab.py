"""Trees of Sparkwire served side by side on one machine: `gpu_serve_check.py` once per tree per
round, the trees alternating (A B, then B A, ...), and each tree's scenarios summarized over its
rounds. This is how served comparisons are made (gpu_serve.md): on one machine, in one call,
because two GPU hosts differ by more than most changes do.

A tree is a directory holding the repository's `ops/` and `services/` (`.` for this checkout, or a
`git archive` of another commit); each run uses that tree's own `gpu_serve_check.py` and code.
Per tree and scenario: output tok/s, TTFT and ITL p50 and, from the step trace, the decode step's
ms, the host's ms a step (the step less its readback wait), the share of steps the host was late
for, the time-weighted decode batch, the step thread's time held by publishing and between
steps, and a closed loop's slot idle time with its parts (`gpu_serve_check.closed_loop_turnaround`).
Where a run holds both `concurrency` and `concurrency_logprobs` (or both batch-1
scenarios), top-20's cost in that run; its mean is the cost of the tree's summed tok/s.

    sparkwire bench gpu-serve-ab --tree after=. --tree before=/tmp/before --rounds 4 --out $OUT/ab.json -- \
        --model-config ops/model_configs/Qwen3-0.6B --no-core-baseline --scenarios concurrency concurrency_logprobs --num-prompts 2560
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ops.bench.common import script

PAIRS = (("concurrency", "concurrency_logprobs"), ("batch1", "batch1_logprobs"))  # (plain, top-20)
DECODE_KINDS = ("decode_followed", "decode")  # the trace's decode rows, followed (overlapped) first
RUN_TIMEOUT_S = 900


def alternating(labels: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, tree) in run order: the trees in order, then reversed, and so on (A B B A ...), so
    a drift of the machine over the call weighs on each tree alike."""
    return [(i, label) for i in range(rounds) for label in (labels if i % 2 == 0 else labels[::-1])]


def run_tree(tree: Path, check_args: list[str], out: Path) -> dict[str, Any]:
    """One `gpu_serve_check.py` run in `tree`, with its code first on the path; its JSON, or an error."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))}
    command = [sys.executable, str(tree / "ops/bench/gpu_serve_check.py"), *check_args, "--out", str(out)]
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {RUN_TIMEOUT_S} s"}
    if not out.is_file():  # the run's own JSON records a failed scenario or a stack that did not come up
        return {"error": f"exit {done.returncode}: {(done.stdout + done.stderr)[-2000:]}"}
    return json.loads(out.read_text())


def scenario_figures(scenario: dict[str, Any]) -> dict[str, Any]:
    """A scenario's figures (None where its run has no step trace)."""
    if "output_throughput" not in scenario:
        return {"error": str(scenario.get("error", "no result"))[:500]}
    figures = {"tok_s": scenario["output_throughput"], "ttft_p50_ms": scenario["ttft_ms"]["p50"], "itl_p50_ms": scenario["itl_ms"]["p50"]}
    trace = scenario.get("step_trace") or {}
    decode = next((trace["kinds"][kind] for kind in DECODE_KINDS if kind in trace.get("kinds", {})), None)
    if decode is not None:
        figures |= {"decode_ms": decode["ms_per_step"], "host_ms": decode.get("host_ms"), "host_late_share": decode.get("host_late_share"),
                    "decode_batch": trace["decode_batch_time_weighted"], "held_s": trace["held_s"], "span_s": trace["span_s"],
                    "between_steps_ms": 1e3 * _between_steps_s(trace) / trace["num_steps"]}  # fmt: skip
    return figures | (scenario.get("turnaround") or {})  # a closed loop's slot idle time and its parts (gpu_serve_check)


def _between_steps_s(trace: dict[str, Any]) -> float:
    """The summary's own figure; traces summarized before it existed: the span less the steps and
    every turn (the first turn's few microseconds included)."""
    if "between_steps_s" in trace:
        return trace["between_steps_s"]
    return trace["span_s"] - trace["busy_s"] - trace["held_s"] - trace["waited_for_work_s"]


def costs(scenarios: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Top-20's cost in one run, per pair it holds: top-20 tok/s over plain, less 1."""
    return {plain: scenarios[top]["tok_s"] / scenarios[plain]["tok_s"] - 1 for plain, top in PAIRS
            if "tok_s" in scenarios.get(plain, {}) and "tok_s" in scenarios.get(top, {})}  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tree: each scenario's figures as (mean, min, max) over the rounds, and top-20's cost a
    round and of the summed tok/s. runs: {"tree", "scenarios": {name: figures}} in any order."""
    summary: dict[str, dict[str, Any]] = {}
    for tree in dict.fromkeys(run["tree"] for run in runs):
        mine = [run["scenarios"] for run in runs if run["tree"] == tree and "error" not in run]
        scenarios: dict[str, Any] = {}
        for name in dict.fromkeys(name for run in mine for name in run):
            values = [run[name] for run in mine if "tok_s" in run.get(name, {})]
            keys = [key for key in values[0] if all(v.get(key) is not None for v in values)] if values else []
            scenarios[name] = {key: _spread([v[key] for v in values]) for key in keys}
        run_costs = [costs(run) for run in mine]
        top20 = {plain: {"rounds": [cost[plain] for cost in run_costs if plain in cost]} for plain, _ in PAIRS}
        for plain, top in PAIRS:
            if top20[plain]["rounds"]:
                top20[plain]["of_summed_tok_s"] = scenarios[top]["tok_s"]["mean"] / scenarios[plain]["tok_s"]["mean"] - 1
        summary[tree] = {"rounds": len(mine), "scenarios": scenarios, "top20_cost": {k: v for k, v in top20.items() if v["rounds"]}}
    return summary


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def table(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["| tree | scenario | rounds | tok/s (mean) | top-20 cost, each round / of the means | decode ms | host ms | host late | "
             "decode batch | held s | between steps ms | slot idle ms (client / queued / in stack), means |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for tree, figures in summary.items():
        for name, row in figures["scenarios"].items():
            cost = figures["top20_cost"].get(name)
            cost_text = (" / ".join(f"{100 * c:+.2f}" for c in cost["rounds"]) + f" / **{100 * cost['of_summed_tok_s']:+.2f}%**") if cost else ""
            cells = [_range(row, key, digits) for key, digits in
                     (("decode_ms", 3), ("host_ms", 3), ("host_late_share", 2), ("decode_batch", 1), ("held_s", 2), ("between_steps_ms", 3))]  # fmt: skip
            tok_s = f"{row['tok_s']['mean']:,.0f}" if "tok_s" in row else "failed"
            parts = " / ".join(f"{row[key]['mean']:.2f}" for key in ("client_ms", "queued_ms", "in_stack_ms") if key in row)
            idle = f"{row['slot_idle_ms']['mean']:.2f} ({parts})" if "slot_idle_ms" in row else ""
            lines.append(f"| {tree} | {name} | {figures['rounds']} | {tok_s} | {cost_text} | {' | '.join(cells)} | {idle} |")
    return "\n".join(lines)


def _range(row: dict[str, Any], key: str, digits: int) -> str:
    if key not in row:
        return ""
    spread = row[key]
    return f"{spread['min']:.{digits}f}-{spread['max']:.{digits}f}"


def strip_requests(value: Any) -> Any:
    """A run's JSON without its per-request lists (what makes it megabytes)."""
    if isinstance(value, dict):
        return {k: strip_requests(v) for k, v in value.items() if k != "requests"}
    return [strip_requests(v) for v in value] if isinstance(value, list) else value


def write_results(out: Path, trees: dict[str, str], check_args: list[str], runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The runs so far and their summary, to `out` (replaced whole); the summary."""
    summary = summarize(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"trees": trees, "check_args": check_args, "summary": summary, "runs": runs}, indent=1) + "\n")
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tree", action="append", required=True, metavar="LABEL=DIR", help="a tree to serve (twice or more)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("check_args", nargs=argparse.REMAINDER, metavar="-- GPU-SERVE FLAGS", help="after --: each run's gpu-serve flags")


def main(args: argparse.Namespace) -> int:
    check_args = args.check_args[1:] if args.check_args[:1] == ["--"] else args.check_args
    trees = dict(tree.split("=", 1) for tree in args.tree)
    if len(trees) < 2 or any(not (Path(d) / "ops/bench/gpu_serve_check.py").is_file() for d in trees.values()):
        raise SystemExit("--tree LABEL=DIR at least twice, each DIR holding ops/bench/gpu_serve_check.py")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="serve_ab_") as scratch:
        for index, (round_index, label) in enumerate(alternating(list(trees), args.rounds)):
            result = run_tree(Path(trees[label]).resolve(), check_args, Path(scratch) / f"{index}.json")
            scenarios = {name: scenario_figures(s) for name, s in result.get("scenarios", {}).items()}
            runs.append({"round": round_index, "tree": label, "scenarios": scenarios, "ready_s": result.get("ready_s"),
                         **({"error": result["error"]} if "error" in result else {}), "result": strip_requests(result)})  # fmt: skip
            print(f"round {round_index} {label}: " + ("failed: " + result["error"][-300:] if "error" in result else
                  ", ".join(f"{n} {s['tok_s']:,.0f} tok/s" for n, s in scenarios.items() if "tok_s" in s)), flush=True)  # fmt: skip
            summary = write_results(args.out, trees, check_args, runs)  # after every run: a call cut short keeps its rounds
    print(table(summary))
    return 1 if any("error" in run for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
