"""Host time per decode step of the scheduler core, model compute left out, on the CPU.

What a decode step costs the host around the device work, piece by piece, on the bundled tiny model
(fp32): each piece's functions are wrapped with a timer while the core decodes (its tokens are the
model's; nothing is simulated), and the output of each step is packed as the service publishes it:

- schedule:  `Policy.schedule` (admission, KV reservation, the plan of every sequence), or
             `Policy.expect` for a step planned ahead (overlapped steps)
- inputs:    the worker's host arrays: layout, logprob queries and their inputs, `HostUpload.send`
- readback:  registering the step's device results for the one copy and queueing it (`StepParts`' verify,
             greedy and logprobs, `HostReadback.start`), then splitting the host copy (`PendingReadback.wait`;
             on the CPU the copy itself is a clone, timed too)
- unpack:    the readback's columns -> per-sequence `SeqResult`s (`StepParts.results`)
- update:    `Policy.update` (tokens, finishes, logprob entries -> `RequestOutput`s)
- core:      `SchedulerCore`'s own bookkeeping per step (counts, releases)
- wire:      `wire.to_token_batches` + msgpack encoding of every `TokenBatch`
- gc:        the garbage collector's runs inside the above (mostly young collections), timed by
             `gc.callbacks`; with `--collector tuned` (the services' default) the process runs as a
             service does: inside `memory.collector_tuned`, its start-up heap frozen before timing

"host" is their sum; "step" the whole `core.step` wall time, which on the CPU includes the tiny model's
forward and the logprob ops (so it says nothing about a GPU's). Figures are lower quartiles over the
timed decode steps (medians too, in the JSON), in microseconds, for batch 1 and 64 with no logprobs, top-20 output logprobs, and top-20 plus
four requested token ids. `--profile` adds a cProfile of the host pieces (batch 64, top-20 + ids):
the functions with the most own time. `--before PATH` runs that tree's own copy of this script (e.g. a
`git worktree` of the starting commit) and on this one, each in a subprocess, alternately for
`--rounds` rounds, and records each figure's best round for both trees in one results file.
`--compare-collectors` does the same with this tree under `--collector default` and `tuned`.
`--churn STEPS` times a batch that changes instead (served paths on): 64 requests of 64-token prompts
and 40-120 new tokens, a new one added as each finishes, STEPS steps; each piece's median per step
kind: a steady decode step, one where a request finished, a mixed step (an arrival's prefill beside
the decodes), and a mixed step where one finished (the served trace's host-late steps follow such
changes: gpu_serve.md).
`--served-paths` runs the paths `sparkwire up` serves on a GPU through their CPU twins: decode steps
on the decode graphs' padded twin (`prepare_decode_graphs(capture=False)`), output logprobs from
`LogprobGraphs` and greedy steps' tokens and rows from `LogprobGraphs.greedy` (without it, the
core's defaults: eager decode, eager logprobs).

    sparkwire bench host-step --before DIR --rounds 3 --profile --out ops/bench/results/host_step_cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import numpy as np
import torch

from contracts.scheduler import LogprobParams, SamplingParams
from ops.bench import scheduler_harness as harness
from ops.bench.common import REPO, RESULTS, script, write_json
from ops.bench.scheduler_harness import publish
from services.common import memory
from services.models import RANDOM_TINY_MODEL
from services.scheduler.model import load_model_runner

PROMPT_LEN = 16
LOGPROBS = {
    "none": LogprobParams(),
    "top20": LogprobParams(return_logprob=True, top_logprobs_num=20),
    "top20_ids": LogprobParams(return_logprob=True, top_logprobs_num=20, token_ids_logprob=(3, 7, 11, 13)),
}
PIECES = harness.host_step_pieces()  # piece -> (owner, attribute) of the functions timed for it


class CollectorClock:
    """Seconds the garbage collector ran, and its runs per generation, while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.runs = [0, 0, 0]
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.runs[info["generation"]] += 1

    @contextlib.contextmanager
    def installed(self):
        gc.callbacks.append(self._callback)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._callback)
HOST_PIECES = (*PIECES, "wire")


class PieceTimer:
    """Seconds spent in each piece during one step (reset per step)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def installed(self):
        saved = []
        for piece, targets in PIECES.items():
            for owner, name in targets:
                original = getattr(owner, name, None)
                if original is None:
                    continue
                saved.append((owner, name, original))
                setattr(owner, name, self._timed(piece, original))
        try:
            yield self
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)

    def _timed(self, piece: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[piece] += time.perf_counter() - start

        return timed


def requests(batch: int, logprobs: LogprobParams, vocab: int, new_tokens: int) -> list:
    prompts = np.random.default_rng(batch).integers(0, vocab, size=(batch, PROMPT_LEN), dtype=np.int32)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [harness.new_request(f"r{i}", p, sampling, logprobs, detokenizer=f"d{i % 2}") for i, p in enumerate(prompts)]


def measure(runner, batch: int, logprobs: str, new_tokens: int, warm_steps: int = 3, served_paths: bool = False) -> dict:
    """Prefill and `warm_steps` decode steps, then every piece's time per decode step until all finish."""
    core = make_core(runner, batch, served_paths)
    for request in requests(batch, LOGPROBS[logprobs], runner.config.vocab_size, new_tokens):
        core.add(request)
    encoder = msgspec.msgpack.Encoder()
    for _ in range(1 + warm_steps):
        publish(core.step(), harness.num_steps(core), encoder)
    per_step: dict[str, list[float]] = defaultdict(list)
    payload = []
    collector = CollectorClock()
    while core.has_work():
        timer = PieceTimer()
        collected_before = collector.seconds
        with timer.installed(), collector.installed():
            start = time.perf_counter()
            outputs = core.step()
            per_step["step"].append(time.perf_counter() - start)
            step = harness.num_steps(core)
            start = time.perf_counter()
            payload.append(publish(outputs, step, encoder))
            timer.seconds["wire"] = time.perf_counter() - start
        for piece in HOST_PIECES:
            per_step[piece].append(timer.seconds[piece])
        per_step["host"].append(sum(timer.seconds[piece] for piece in HOST_PIECES))
        per_step["gc"].append(collector.seconds - collected_before)
    # the lower quartile: the decode steps timed are alike, and on a shared machine the quartile is the
    # undisturbed cost where a median moves with whatever else runs (both are recorded)
    quartiles = {f"{name}_us": 1e6 * _lower_quartile(values) for name, values in per_step.items()}
    medians = {f"{name}_median_us": 1e6 * statistics.median(values) for name, values in per_step.items()}
    means = {"gc_mean_us": 1e6 * statistics.fmean(per_step["gc"])}  # rare and long: its mean is its cost
    return {"batch": batch, "logprobs": logprobs, "steps": len(per_step["step"]), "gc_runs": collector.runs,
            "payload_bytes": int(statistics.median(payload)), **quartiles, **medians, **means}  # fmt: skip


CHURN_GROUPS = ("decode", "decode+finish", "mixed", "mixed+finish")
CHURN_PROMPT_LEN, CHURN_LENGTHS = 64, (40, 120)  # `--churn`'s requests: prompt tokens, new tokens drawn from [lo, hi)


def measure_churn(runner, logprobs: str, num_steps: int, batch: int = 64, lengths: tuple[int, int] = CHURN_LENGTHS,
                  prompt_len: int = CHURN_PROMPT_LEN) -> list[dict]:  # fmt: skip
    """`--churn`: each piece's median per step kind (`CHURN_GROUPS`) over `num_steps` steps of a batch
    that changes, the first 20 left out (the batch filling); a kind no step fell in has steps 0."""
    rng = np.random.default_rng(batch)
    core = make_core(runner, batch, served_paths=True)
    added = 0

    def add() -> None:
        nonlocal added
        prompt = rng.integers(0, runner.config.vocab_size, size=prompt_len, dtype=np.int32)
        sampling = SamplingParams(max_new_tokens=int(rng.integers(*lengths)), temperature=0.0, ignore_eos=True)
        core.add(harness.new_request(f"r{added}", prompt, sampling, LOGPROBS[logprobs], detokenizer=f"d{added % 2}"))
        added += 1

    for _ in range(batch):
        add()
    encoder = msgspec.msgpack.Encoder()
    steps: dict[str, list[dict[str, float]]] = {group: [] for group in CHURN_GROUPS}
    for index in range(num_steps):
        timer = PieceTimer()
        with timer.installed():
            outputs = core.step()
            step = harness.num_steps(core)
            start = time.perf_counter()
            publish(outputs, step, encoder)
            timer.seconds["wire"] = time.perf_counter() - start
        finished = sum(output.finish is not None for output in outputs)
        for _ in range(finished):
            add()
        record = harness.last_step(core)
        if record is not None and index >= 20:
            group = ("mixed" if record.num_prefill_tokens else "decode") + ("+finish" if finished else "")
            steps[group].append({piece: timer.seconds[piece] for piece in HOST_PIECES})
    rows = []
    for group, timed in steps.items():
        medians = {f"{piece}_us": 1e6 * statistics.median(t[piece] for t in timed) if timed else 0.0 for piece in HOST_PIECES}
        host = 1e6 * statistics.median(sum(t.values()) for t in timed) if timed else 0.0
        rows.append({"batch": batch, "logprobs": f"{logprobs}, {group}", "steps": len(timed), **medians, "host_us": host})
    return rows


def _lower_quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4)[0] if len(values) > 1 else values[0]


def make_core(runner, batch: int, served_paths: bool):
    """served_paths: the logprob graphs' twins too (the runner's decode graphs: `run`)."""
    graphs = {"logprob_graphs": True, "greedy_logprob_graphs": True} if served_paths else {}
    return harness.core_for(runner, max_running_requests=max(batch, 64), chunked_prefill_size=4096, **graphs)


def profile_host(runner, batch: int, logprobs: str, new_tokens: int, limit: int = 25, served_paths: bool = False) -> str:
    """cProfile of the decode steps' host pieces only (the timed functions, not the model)."""
    profiler = cProfile.Profile()

    class ProfiledTimer(PieceTimer):
        def _timed(self, piece, function):
            @functools.wraps(function)
            def timed(*args, **kwargs):
                return profiler.runcall(function, *args, **kwargs)

            return timed

    core = make_core(runner, batch, served_paths)
    for request in requests(batch, LOGPROBS[logprobs], runner.config.vocab_size, new_tokens):
        core.add(request)
    encoder = msgspec.msgpack.Encoder()
    for _ in range(4):
        publish(core.step(), harness.num_steps(core), encoder)
    with ProfiledTimer().installed():
        while core.has_work():
            outputs = core.step()
            profiler.runcall(publish, outputs, harness.num_steps(core), encoder)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(limit)
    return text.getvalue()


def run(batches, new_tokens: int, profile: bool, collector: str = "tuned", served_paths: bool = False, churn: int = 0) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the model's CPU compute is not what is measured; keep it from competing
    served_paths = served_paths or churn > 0
    with _collector(collector):
        runner = load_model_runner(RANDOM_TINY_MODEL, device="cpu", dtype=torch.float32, num_kv_blocks=1024, kv_block_size=16)
        if served_paths:  # every batch on a rung (1 and 64 both are), every request's blocks in its table
            longest = CHURN_PROMPT_LEN + CHURN_LENGTHS[1] if churn else PROMPT_LEN + new_tokens
            runner.prepare_decode_graphs(max_blocks_per_seq=-(-longest // 16) + 1, capture=False)
        measure(runner, 8, "top20_ids", 8, served_paths=served_paths)  # warm-up: first calls, allocator
        if collector == "tuned":
            memory.settle_startup_heap()  # as a service does once ready
        if churn:
            rows = [row for name in LOGPROBS for row in measure_churn(runner, name, churn)]
        else:
            rows = [measure(runner, batch, name, new_tokens, served_paths=served_paths) for batch in batches for name in LOGPROBS]
    result = {"model": RANDOM_TINY_MODEL.name, "torch": torch.__version__, "new_tokens": new_tokens, "collector": collector,
              "served_paths": served_paths, "churn_steps": churn, "rows": rows}  # fmt: skip
    if profile:
        result["profile"] = profile_host(runner, max(batches), "top20_ids", new_tokens, served_paths=served_paths)
    return result


def _collector(mode: str):
    """The services' collector settings (`memory.collector_tuned`), or CPython's own; a tree from
    before those settings has only CPython's."""
    if mode == "tuned" and hasattr(memory, "collector_tuned"):
        return memory.collector_tuned()
    return contextlib.nullcontext()


def table(rows: list[dict], label: str = "") -> str:
    names = [*HOST_PIECES, "host", "gc", "step"]
    lines = [f"| tree | batch | logprobs | {' | '.join(names)} |", "|---|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = " | ".join(f"{r.get(f'{n}_mean_us', r.get(f'{n}_us', float('nan'))):.0f}" if f"{n}_us" in r else "" for n in names)
        lines.append(f"| {label} | {r['batch']} | {r['logprobs']} | {cells} |")
    return "\n".join(lines)


def best_of(results: list[dict]) -> dict:
    """Rounds of one tree -> each figure's smallest (the round the machine disturbed least)."""
    rows = []
    for same in zip(*(r["rows"] for r in results), strict=True):
        rows.append({key: min(row[key] for row in same) if key.endswith("_us") else value for key, value in same[0].items()})
    return results[-1] | {"rows": rows, "rounds": len(results)}


def compare_collectors(argv: list[str], rounds: int) -> dict:
    """This tree under CPython's collector and under the services' tuned one, alternately."""
    from ops.bench.other_tree import run_on_tree

    runs: dict[str, list] = {"default": [], "tuned": []}
    for _ in range(rounds):
        for mode, results in runs.items():
            results.append(run_on_tree(__file__, REPO, [*argv, "--collector", mode, "--print-json"]))
    return {mode: best_of(results) for mode, results in runs.items()}


def compare(before_tree: Path, argv: list[str], rounds: int, profile: bool) -> dict:
    """Before and after alternately, `rounds` times each, so both see the same load."""
    from ops.bench.other_tree import alternate  # the parent's only: the child imports from the other tree

    trees = {"before": before_tree, "after": REPO}
    runs = alternate(__file__, trees, argv, rounds, last_round_extra=["--profile"] if profile else [])
    return {name: best_of(results) | {"tree": str(trees[name])} for name, results in runs.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 64])
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per request (decode steps timed: this - 4)")
    parser.add_argument("--profile", action="store_true", help="add a cProfile of the host pieces")
    parser.add_argument("--before", type=Path, help="another tree to measure with its own copy of this script, in the same run")
    parser.add_argument("--rounds", type=int, default=3, help="with --before: alternate rounds of each tree")
    parser.add_argument("--collector", choices=memory.COLLECTOR_MODES, default="tuned", help="the garbage collector's settings")
    parser.add_argument("--compare-collectors", action="store_true", help="this tree under each --collector, alternately")
    parser.add_argument("--served-paths", action="store_true", help="decode graphs' and logprob graphs' CPU twins, as served on a GPU")
    parser.add_argument("--churn", type=int, default=0, metavar="STEPS", help="a batch that changes, this many steps (served paths)")
    parser.add_argument("--out", type=Path, default=RESULTS / "host_step_cost.json")
    parser.add_argument("--print-json", action="store_true", help=argparse.SUPPRESS)  # a subprocess's output


def main(args: argparse.Namespace) -> int:
    common = ["--batches", *map(str, args.batches), "--new-tokens", str(args.new_tokens), *(["--served-paths"] if args.served_paths else []),
              *(["--churn", str(args.churn)] if args.churn else [])]  # fmt: skip
    if args.compare_collectors:
        result = compare_collectors(common, args.rounds)
        print(table(result["default"]["rows"], "default collector"))
        print(table(result["tuned"]["rows"], "tuned collector").split("\n", 2)[2])
    elif args.before is not None:
        result = compare(args.before.resolve(), common, args.rounds, args.profile)
        print(table(result["before"]["rows"], "before"))
        print(table(result["after"]["rows"], "after").split("\n", 2)[2])
    else:
        result = run(tuple(args.batches), args.new_tokens, args.profile, args.collector, args.served_paths, args.churn)
        if args.print_json:
            print(json.dumps(result))
            return 0
        print(table(result["rows"]))
    write_json(args.out, result)
    if args.profile:
        print((result.get("after") or result)["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
