"""The scheduler core's step on one GPU: before/after the policy/worker split, the runner's graph
step as the floor, verify steps (q = k + 1), and DSpark at a simulated accept length.

All on the Qwen3-8B shape with dummy bf16 weights (`ops/model_configs/Qwen3-8B`), 128-token prompts:

- runner: one graph replay of a decode step (q = 1) and a verify step (q = 8) at batch 1 and 64
  (CUDA events, median of 50) — the floor a core step can reach;
- core: ms per decode step at batch 1 and 64 (plain greedy, and with top-20 output logprobs, eager
  and from `LogprobGraphs`: `top20_graphs`), each run's core warmed up at the timed prompt length and
  timed `--rounds` times in a rotating order (the median kept, every round's place recorded: an
  effect of the order shows as a spread), this tree and, in a subprocess on `--before PATH` (an export of the previous tree), the old core;
- host syncs per decode step: torch.cuda.set_sync_debug_mode counts synchronizing calls;
- DSpark with the 8B-shape dummy drafter (`ops/model_configs/Qwen3-8B-dspark`), EXPLICITLY
  SIMULATED accept length (`--simulate-accept-len`, default 4: every verify keeps 3 drafts + the
  bonus, whatever the target says): draft + verify ms per step and output tok/s against plain
  decoding, with and without top-20 logprobs (eager and from graphs), in rotated rounds as the core;
- top-20 cost: 1 - tok/s with top-20 output logprobs / tok/s without, plain and DSpark (median
  rounds), at each batch, eager and with logprob graphs, from the rows above (same run);
- the output-logprob path alone (`logprobs_on_device`, raw, top-20 for every row) on random
  bf16-rounded logits of the target's vocabulary, as plain decode (1 row per request) and DSpark
  verify (gamma + 1 rows) lay it out: ms per call back to back and alone, host ms to issue it, eager
  and from `LogprobGraphs` (captures and their ms; graphs equal to eager exactly, raw and processed); and
  its top-k against a candidate with one top-k instead of two (`_top_k_by_running_count`).

    sparkwire bench gpu-core --before DIR --out $OUT/gpu_core.json   # DIR: a checkout of the tree before
    sparkwire bench gpu-core --logprob-cost --out $OUT/gpu_core_logprobs.json  # core, DSpark, syncs, the last two
    sparkwire bench gpu-core --device cpu --tiny --out /tmp/core.json  # smoke: the tiny model, a dummy drafter for it
    sparkwire bench gpu-core --speedup --budget-s 140 --out $OUT/speedup.json  # issue 46: replayed acceptance

`--speedup` compares tok/s at a held batch (`time_core`: the steps before the first request
finishes, every request running), the same way for plain and DSpark; with replayed acceptance
DSpark's requests finish at different steps, and the whole run's tok/s (`*_drained`, kept beside)
also charges DSpark the tail in which the batch drains.

`--before DIR` runs DIR's own copy of this file (`--core-only`), so each tree's core is built by its
own `scheduler_harness`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from contracts.scheduler import LogprobParams, SamplingParams
from ops.bench import dspark_sps
from ops.bench import scheduler_harness as harness
from ops.bench.accept_replay import ALPHA, AcceptReplay
from ops.bench.common import MODEL_CONFIGS, RESULTS, bench_dtype, device_name, script, synchronize, write_json
from services.scheduler.model.loader import load_model_runner
from services.scheduler.model.ragged_graphs import seq_ladder, token_ladder
from services.scheduler.model.runner import triton_available

TARGET = MODEL_CONFIGS / "Qwen3-8B"
DRAFT = MODEL_CONFIGS / "Qwen3-8B-dspark"
TOP20 = LogprobParams(return_logprob=True, top_logprobs_num=20)


def requests(batch: int, prompt_len: int, new_tokens: int, vocab: int, logprobs: LogprobParams, tag: str):
    prompts = np.random.default_rng(batch).integers(0, vocab, size=(batch, prompt_len), dtype=np.int32)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [harness.new_request(f"{tag}{i}", p, sampling, logprobs) for i, p in enumerate(prompts)]


def time_core(core, reqs, warm_steps: int = 3, ids: dict[str, list[int]] | None = None) -> dict:
    """Prefill, then time the decode steps (after `warm_steps`) until every request finishes; `ids`
    (where given) gets every request's output ids, the untimed steps' too, by rid.

    Also the held batch (`held_*`): the steps before the first request finishes, every request
    still running, as a server at a steady concurrency keeps them. Where requests commit different
    numbers of tokens a step (replayed DSpark acceptance) they finish at different steps and the
    batch drains through a tail of steps with fewer rows, which plain decoding never has: over the
    whole run (`tok_s`) that tail is charged to the mode, over the held steps it is not. `mean_rows`:
    sequences a timed step ran, on average."""
    for r in reqs:
        core.add(r)
    for _ in range(1 + warm_steps):  # prefill (and the first token), then a few decode steps
        _collect(ids, core.step())
    device = harness.runner_of(core).device.type
    synchronize(device)
    held = {"tokens": 0, "steps": 0, "wall": 0.0}
    tokens, steps, rows, holding = 0, 0, 0, True
    start = time.perf_counter()
    while core.has_work():
        outputs = core.step()  # returns once its readback is on the host: the device ran it
        _collect(ids, outputs)
        step_tokens = sum(len(o.new_token_ids) for o in outputs)
        record = harness.last_step(core)
        num_rows = record.num_seqs if record is not None else 0
        tokens, steps, rows = tokens + step_tokens, steps + 1, rows + num_rows
        holding = holding and num_rows == len(reqs) and not any(o.finish is not None for o in outputs)
        if holding:
            held = {"tokens": held["tokens"] + step_tokens, "steps": held["steps"] + 1, "wall": time.perf_counter() - start}
    synchronize(device)
    wall = time.perf_counter() - start
    return {"ms_per_step": 1e3 * wall / max(steps, 1), "tok_s": tokens / wall, "steps": steps, "tokens": tokens,
            "mean_rows": rows / max(steps, 1), "held_tok_s": held["tokens"] / held["wall"] if held["wall"] > 0 else 0.0,
            "held_steps": held["steps"], "held_tokens": held["tokens"], "held_ms_per_step": 1e3 * held["wall"] / max(held["steps"], 1)}  # fmt: skip


def _collect(ids: dict[str, list[int]] | None, outputs) -> None:
    if ids is not None:
        for output in outputs:
            ids.setdefault(output.rid, []).extend(output.new_token_ids)


# (row name, logprobs, output logprobs from LogprobGraphs): the top-20 cost, eager and with graphs
LOGPROB_RUNS = (("plain", LogprobParams(), False), ("top20", TOP20, False), ("top20_graphs", TOP20, True))


def core_rows(runner, batches, prompt_len, new_tokens, fused: bool = False, runs=LOGPROB_RUNS, rounds: int = 3) -> list[dict]:
    """Per batch, one core per run (plain, top-20, top-20 from graphs), each warmed up at the timed
    prompt length, then timed in `rotated_rounds`."""
    rows = []
    for batch in batches:
        cores = []
        for name, logprobs, graphs in runs:
            core = harness.core_for(runner, max_running_requests=max(batches), chunked_prefill_size=16384, logprob_graphs=graphs,
                                    fused_logprobs=fused)  # fmt: skip
            time_core(core, requests(batch, prompt_len, 6, runner.config.vocab_size, logprobs, "w"))  # warm-up
            cores.append((name, logprobs, core))
        timed = functools.partial(requests, batch, prompt_len, new_tokens, runner.config.vocab_size)
        rows += [{"batch": batch, **row} for row in rotated_rounds(cores, timed, rounds)]
    return rows


def rotated_rounds(cores, timed_requests, rounds: int, key: str = "tok_s") -> list[dict]:
    """cores: (run name, logprobs, a warmed-up core). Each core is timed `rounds` times in a rotating
    order (round r starts at core r), so that no run is always the one timed first or last after the
    others; one row per core: its median round by `key`, with every round's `key` and place kept."""
    timed: dict[str, list[dict]] = {name: [] for name, _, _ in cores}
    for round_ in range(rounds):
        for place in range(len(cores)):
            name, logprobs, core = cores[(round_ + place) % len(cores)]
            timed[name].append({**time_core(core, timed_requests(logprobs, f"r{round_}-")), "place": place})
    rows = []
    for name, _, _ in cores:
        median = sorted(timed[name], key=lambda r: r[key])[len(timed[name]) // 2]
        rows.append({"logprobs": name, **{k: v for k, v in median.items() if k != "place"},
                     "rounds": [{key: r[key], "place": r["place"]} for r in timed[name]]})  # fmt: skip
    return rows


def graph_rows(runner, batches, widths) -> list[dict]:
    """The runner's graph replay alone (the step's floor): static buffers as the last step left them."""
    graphs = runner.decode_graphs
    rows = []
    if graphs is None or not graphs.graphs:
        return rows  # CPU: nothing captured
    for batch in batches:
        for q in widths:
            key = (graphs.rung(batch), q)
            graph = graphs.graphs[key]
            times = []
            for _ in range(50):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            rows.append({"batch": batch, "query_len": q, "graph_ms": float(np.median(times))})
    return rows


def kernel_rows(context: int = 256) -> list[dict]:
    """The paged kernel against the torch twin (max abs error) and timed, 8B heads, bf16."""
    from triton.testing import do_bench

    from services.scheduler.model.attention import paged_decode_attention_torch
    from services.scheduler.model.triton_decode import paged_block_attention_triton

    rows = []
    for batch, q in ((1, 1), (64, 1), (1, 8), (64, 8)):
        blocks = batch * (context // 16 + 1)
        key_cache, value_cache = (torch.randn(blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        tables = torch.randperm(blocks, device="cuda").view(batch, -1).to(torch.int32)
        seq_lens = torch.randint(context // 2, context, (batch,), device="cuda", dtype=torch.int32)
        query = torch.randn(batch * q, 32, 128, device="cuda", dtype=torch.bfloat16)
        args = (query, key_cache, value_cache, seq_lens, tables, 128**-0.5, q)
        want = paged_decode_attention_torch(*args).float()
        error = (paged_block_attention_triton(*args).float() - want).abs().max().item()
        ms = do_bench(lambda: paged_block_attention_triton(*args), warmup=25, rep=100, return_mode="median")
        rows.append({"kernel": "per_sequence", "batch": batch, "query_len": q, "max_abs_err": error, "ms": ms})
    return rows


def sync_count(runner, batch: int, logprob_graphs: bool = False, fused: bool = False) -> dict:
    """Synchronizing calls during decode steps, as torch's sync debug mode reports them (after two
    warm steps: logprob graphs are captured in those)."""
    if runner.device.type != "cuda":
        return {"batch": batch, "logprob_graphs": logprob_graphs, "syncs_per_decode_step": None}
    core = harness.core_for(runner, max_running_requests=batch, chunked_prefill_size=16384, logprob_graphs=logprob_graphs,
                            fused_logprobs=fused)  # fmt: skip
    for r in requests(batch, 32, 12, runner.config.vocab_size, TOP20, "s"):
        core.add(r)
    core.step()
    core.step()
    counts = []
    for _ in range(4):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            core.step()
            torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    return {"batch": batch, "logprob_graphs": logprob_graphs, "syncs_per_decode_step": counts, "host_reads_per_step": 1}


def dspark_rows(runner, draft: Path, batches, prompt_len, new_tokens, accept_len, fused: bool = False, rounds: int = 3) -> list[dict]:
    proposer = harness.dspark_proposer(runner, draft)
    gamma = proposer.num_draft_tokens
    rows = []
    for batch in batches:
        cores = []
        for name, logprobs, graphs in LOGPROB_RUNS:
            core = harness.core_for(runner, max_running_requests=max(batches), chunked_prefill_size=16384, proposer=proposer,
                                    simulated_accept_len=accept_len, logprob_graphs=graphs, fused_logprobs=fused)  # fmt: skip
            # warm-up as long as the timed run: draft graphs are captured on first use per context bucket,
            # and a shorter warm-up left the last bucket's capture inside the first timed run
            time_core(core, requests(batch, prompt_len, new_tokens, runner.config.vocab_size, logprobs, "w"))
            cores.append((name, logprobs, core))
        timed = functools.partial(requests, batch, prompt_len, new_tokens, runner.config.vocab_size)
        rows += [{"batch": batch, "gamma": gamma, "simulated_accept_len": accept_len, **row}
                 for row in rotated_rounds(cores, timed, rounds)]  # fmt: skip
    return rows


def pair_rows(target: Path, draft: Path, batches, new_tokens: int, device: str) -> list[dict]:
    """The trained pair: plain greedy against DSpark greedy (`trained_pair.speed_rows`) on Python
    prompts (the device's own standard library, first lines of files), the same tokens expected."""
    import glob

    from tokenizers import Tokenizer

    from ops.bench.trained_pair import speed_rows

    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    files = sorted(glob.glob("/usr/lib/python3*/[a-z]*.py"))[: max(batches)] or [__file__] * max(batches)
    prompts = [tokenizer.encode(Path(f).read_text(errors="replace")[:400]).ids[:64] for f in files]
    prompts = [p for p in prompts if len(p) > 4] or [list(range(5, 40))]
    prompts = [prompts[i % len(prompts)] for i in range(max(batches))]
    return speed_rows(target, draft, prompts, batches, new_tokens, device, rounds=1)


# ---- --speedup: plain against DSpark static and compact, replayed acceptance ----

SERVED_RUNS = (("plain", LogprobParams(), False), ("top20", TOP20, True))  # top-20 as served: from logprob graphs


def accept_replay(args, gamma: int) -> AcceptReplay:
    if args.accept_lengths is not None:
        return AcceptReplay.load(args.accept_lengths, gamma)
    return AcceptReplay.geometric(gamma)


def speedup(args, runner, result: dict, deadline: float) -> None:
    """Plain decoding, DSpark `static` and `compact` (its step-cost table profiled on this runner
    first) at every batch, each with and without top-20 (compact: without), acceptance replayed.
    Plain runs first, before the drafter exists: its decode graphs then capture no context layers."""
    rows = _modes_rows(runner, args, [("plain", None, SERVED_RUNS, {})], None, deadline)
    proposer = harness.dspark_proposer(runner, args.draft, confidences=False)  # compact's come from the replay
    gamma, layers = proposer.num_draft_tokens, tuple(proposer.capture_layers)
    replay = accept_replay(args, gamma)
    result["accept_replay"] = {"source": str(args.accept_lengths or f"geometric, alpha {ALPHA}"), **replay.describe()}
    if runner.ragged_kernel:  # compact's ragged verify steps replay ragged graphs, as served
        budget = max(harness.CHUNKED_PREFILL_SIZE, max(args.batches) * (gamma + 1))
        runner.prepare_ragged_graphs(seq_ladder(max(args.batches)), token_ladder(budget), capture_layers=layers)
        runner.ragged_graphs.capture_keys(runner.ragged_graphs.verify_keys(gamma + 1), "verify")
    sps = dspark_sps.profile(runner, gamma, layers, max(args.batches), args.prompt_len, 10, deadline)
    result["sps"] = sps
    cost = dspark_sps.step_cost(sps).points
    modes = [("static", proposer, SERVED_RUNS, {"verify_mode": "static"}),
             ("compact", proposer, SERVED_RUNS[:1], {"verify_mode": "compact", "verify_step_cost": cost})]  # fmt: skip
    rows += _modes_rows(runner, args, modes, replay, deadline)
    result["speedup"] = sorted(rows, key=lambda r: (r["batch"], MODES.index(r["mode"])))
    result["speedup_summary"] = speedup_summary(rows)


MODES = ("plain", "static", "compact")


def _modes_rows(runner, args, modes, replay, deadline: float) -> list[dict]:
    rows = []
    for batch in args.batches:
        for mode, spec, runs, options in modes:
            if time.monotonic() > deadline:
                rows.append({"batch": batch, "mode": mode, "skipped": "over --budget-s"})
                continue
            rows += [{"batch": batch, "mode": mode, **row} for row in _mode_rows(runner, args, batch, spec, runs, replay, options)]
    return rows


def _mode_rows(runner, args, batch: int, proposer, runs, replay, options: dict) -> list[dict]:
    cores = []
    for name, logprobs, graphs in runs:
        core = harness.core_for(runner, max_running_requests=max(args.batches), chunked_prefill_size=16384, proposer=proposer,
                                accept_replay=replay if proposer is not None else None, logprob_graphs=graphs,
                                fused_logprobs=runner.device.type == "cuda" and triton_available(), **options)  # fmt: skip
        time_core(core, requests(batch, args.prompt_len, args.new_tokens, runner.config.vocab_size, logprobs, "w"))  # warm-up
        cores.append((name, logprobs, core))
    timed = functools.partial(requests, batch, args.prompt_len, args.new_tokens, runner.config.vocab_size)
    rows = rotated_rounds(cores, timed, args.rounds, key="held_tok_s")
    for row in rows:
        row["tokens_per_request_step"] = row["tokens"] / max(1, row["steps"] * batch)  # the tail's empty rows count
        row["held_tokens_per_row"] = row["held_tokens"] / max(1, row["held_steps"] * batch)
    return rows


def speedup_summary(rows: list[dict]) -> list[dict]:
    """Per batch: tok/s of each mode at the held batch (`time_core`) and DSpark over plain there,
    the same over the whole drained run (`*_drained`: the definition before), top-20 cost at the
    held batch (targets: 3.0x / 2.0x / 1.5x at 1 / 16 / 64, top-20 <= 5%)."""
    by_run = {(r["batch"], r["mode"], r["logprobs"]): r for r in rows if "tok_s" in r}
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        row = {"batch": batch, "target_speedup": SPEEDUP_TARGETS.get(batch)}
        for key, suffix in (("held_tok_s", ""), ("tok_s", "_drained")):
            tok_s = {(mode, logprobs): run[key] for (b, mode, logprobs), run in by_run.items() if b == batch}
            plain = row[f"plain_tok_s{suffix}"] = tok_s.get(("plain", "plain"))
            for mode in ("static", "compact"):
                value = row[f"{mode}_tok_s{suffix}"] = tok_s.get((mode, "plain"))
                row[f"{mode}_speedup{suffix}"] = value / plain if value and plain else None
        for mode in ("plain", "static"):
            base, top20 = (by_run.get((batch, mode, name), {}).get("held_tok_s") for name in ("plain", "top20"))
            row[f"{mode}_top20_cost"] = 1 - top20 / base if base and top20 else None
            row[f"{mode}_mean_rows"] = by_run.get((batch, mode, "plain"), {}).get("mean_rows")
        out.append(row)
    return out


SPEEDUP_TARGETS = {1: 3.0, 16: 2.0, 64: 1.5}


def speedup_table(result: dict) -> str:
    replay = result["accept_replay"]
    lines = [f"acceptance replayed: {replay['source']}, mean {replay['accept_len_mean']} tokens a verify (the bonus token included)",
             "held batch: the steps before the first request finishes; drained: until the last one does (rows a step: static's mean)",
             "| batch | plain tok/s | static tok/s (x) | compact tok/s (x) | target x | drained: static x, compact x (rows) | top-20 cost plain / DSpark static |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip

    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    for r in result["speedup_summary"]:
        lines.append(f"| {r['batch']} | {fmt(r['plain_tok_s'], '.0f')} | {fmt(r['static_tok_s'], '.0f')} "
                     f"({fmt(r['static_speedup'], '.2f')}) | {fmt(r['compact_tok_s'], '.0f')} ({fmt(r['compact_speedup'], '.2f')}) | "
                     f"{fmt(r['target_speedup'], '.1f')} | {fmt(r['static_speedup_drained'], '.2f')}, "
                     f"{fmt(r['compact_speedup_drained'], '.2f')} ({fmt(r['static_mean_rows'], '.1f')}) | "
                     f"{fmt(r['plain_top20_cost'], '.1%')} / {fmt(r['static_top20_cost'], '.1%')} |")  # fmt: skip
    return "\n".join(lines)


def top20_cost(result: dict) -> list[dict]:
    """1 - tok/s(top-20) / tok/s(plain) per (step kind, batch, eager or graphed logprobs), from the
    median rounds (None: no tokens timed)."""
    rows = []
    for kind, source in (("plain", result["core"]), ("dspark", result["dspark"])):
        tok_s = {(r["batch"], r["logprobs"]): r["tok_s"] for r in source}
        for batch in sorted({b for b, _ in tok_s}):
            for name, graphs in (("top20", False), ("top20_graphs", True)):
                cost = 1 - tok_s[batch, name] / tok_s[batch, "plain"] if tok_s[batch, "plain"] > 0 else None
                rows.append({"step": kind, "batch": batch, "logprob_graphs": graphs, "top20_cost": cost, "target": 0.05})
    return rows


def logprob_path_rows(runner, batches, width: int, k: int = 20, repeat: int = 20, fused: bool = False) -> list[dict]:
    """`logprobs_on_device` alone, raw top-k for every row, as a step of `batch` requests with 1 row
    each (plain decode) or `width` rows each (DSpark verify) lays it out, on bf16-rounded random
    logits of the target's vocabulary (ties as a bf16 model has them). Median ms per call of: the
    host launching it; the call alone (CUDA events around it: launch gaps count); and `repeat` calls
    back to back (the device time a step pays when the host is ahead, as it is behind a forward).
    The same from `LogprobGraphs` (graph_*; its captures counted and timed apart), and whether graphs
    and eager agree exactly, raw and processed (temperature, top-k, top-p, min-p mixed over rows)."""
    from services.scheduler.logprob_graphs import LogprobGraphs
    from services.scheduler.logprobs import LogprobQuery, TopKKeys, logprob_inputs, logprobs_on_device

    device, vocab = runner.device, runner.config.vocab_size
    keys = TopKKeys.build(vocab, device)
    rows = []
    for batch in batches:
        for rows_each in (1, width):
            n = batch * rows_each
            logits = (4 * torch.randn(n, vocab, device=device)).to(torch.bfloat16).float()  # [n, V]
            queries = [LogprobQuery(np.arange(i * rows_each, (i + 1) * rows_each), None, k, ()) for i in range(batch)]
            inputs = {name: torch.from_numpy(a).to(device) for name, a in logprob_inputs(queries, False, n).items()}
            sampled = logits.argmax(dim=-1)  # [n]

            def call():
                return logprobs_on_device(queries, inputs, logits, None, keys, False, sampled, fused)

            graphs = LogprobGraphs(keys, capture=device.type == "cuda", fused=fused)

            def graphed():
                return graphs.compute(queries, inputs, logits, False, sampled)

            agree = _same(call(), graphed())  # the first graphed call captures
            rows.append({"batch": batch, "rows_per_request": rows_each, "rows": n, "k": k,
                         **_path_times(device, call, repeat, ""), **_path_times(device, graphed, repeat, "graph_"),
                         "graph_captures": graphs.num_captured, "graph_capture_ms": 1e3 * graphs.capture_s,
                         "graphs_agree_raw": agree, "graphs_agree_processed": _processed_agree(queries, logits, sampled, keys),
                         **_top_k_variants(logits.log_softmax(dim=-1), k, keys, repeat)})  # fmt: skip
    return rows


def _path_times(device, call, repeat: int, prefix: str) -> dict:
    timings = [_timed(device, call, 1) for _ in range(repeat + 3)][3:]
    back_to_back = [_timed(device, call, repeat)[0] / repeat for _ in range(3)]
    return {f"{prefix}host_ms": float(np.median([h for _, h in timings])),
            f"{prefix}alone_ms": float(np.median([d for d, _ in timings])),
            f"{prefix}back_to_back_ms": float(np.median(back_to_back))}  # fmt: skip


def _same(want, got) -> bool:
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(want.columns(), got.columns(), strict=True))


def _processed_agree(queries, logits, sampled, keys) -> bool:
    """Processed mode, graphs against eager on the same rows, requests' sampling parameters mixed."""
    from msgspec.structs import replace

    from services.scheduler.logprob_graphs import LogprobGraphs
    from services.scheduler.logprobs import logprob_inputs, logprobs_on_device

    params = (SamplingParams(temperature=0.7, top_k=50), SamplingParams(temperature=1.2, top_p=0.9, min_p=0.02), SamplingParams())
    queries = [replace(q, sampling=params[i % len(params)]) for i, q in enumerate(queries)]
    inputs = {name: torch.from_numpy(a).to(logits.device) for name, a in logprob_inputs(queries, True, logits.shape[0]).items()}
    graphs = LogprobGraphs(keys, capture=logits.device.type == "cuda")
    want = logprobs_on_device(queries, inputs, logits, None, keys, True, sampled)
    return _same(want, graphs.compute(queries, inputs, logits, True, sampled)) and _same(
        want, graphs.compute(queries, inputs, logits, True, sampled))  # fmt: skip  # the capture, then a replay


def _top_k_variants(logprobs: torch.Tensor, k: int, keys, repeat: int) -> dict:
    """Back-to-back ms of `top_k_sorted` (serving) and of `_top_k_by_running_count` (a candidate), and
    whether they agree exactly, on the same logprobs."""
    from services.scheduler.logprobs import top_k_sorted

    def serving():
        return top_k_sorted(logprobs, k, keys)

    def candidate():
        return _top_k_by_running_count(logprobs, k)

    same = all(torch.equal(a, b) for a, b in zip(serving(), candidate(), strict=True))
    ms = {name: float(np.median([_timed(logprobs.device, f, repeat)[0] / repeat for _ in range(3)]))
          for name, f in (("top_k_sorted_ms", serving), ("top_k_running_count_ms", candidate))}  # fmt: skip
    return ms | {"top_k_variants_agree": same}


def _top_k_by_running_count(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CANDIDATE for `top_k_sorted`, timed here only: the same result with one top-k over the row
    instead of two. The ids above the k-th value are the top-k's first `num_above`; the j-th smallest
    id equal to it is where the running count of (logprobs == kth) first reaches j (searchsorted)."""
    n, vocab = logprobs.shape
    ranks = torch.arange(k + 1, device=logprobs.device)  # [k + 1]
    values, top_ids = logprobs.topk(k, dim=-1)  # [n, k]
    kth = values[:, -1:]  # [n, 1]
    running = (logprobs == kth).cumsum(dim=-1, dtype=torch.int32)  # [n, V]
    tied_ids = torch.searchsorted(running, ranks[1:].to(torch.int32).expand(n, k).contiguous())  # [n, k]
    num_above = (values > kth).sum(dim=-1, keepdim=True)  # [n, 1]
    slot = ranks[:k]
    from_tied = tied_ids.gather(1, (slot - num_above).clamp_min(0))
    ids = torch.where(slot < num_above, top_ids, from_tied).clamp_max(vocab - 1)  # the set; values: still `values`
    ids, order = ids.sort(dim=-1)
    values, order = values.gather(1, order).sort(dim=-1, descending=True, stable=True)  # ties by the smaller id
    return values, ids.gather(1, order).to(torch.int32)


def _timed(device: torch.device, call, times: int) -> tuple[float, float]:
    """(ms from before the first call until the device finished the last, ms the host took to issue them)."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(times):
            call()
        elapsed = 1e3 * (time.perf_counter() - start)
        return elapsed, elapsed
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    start = time.perf_counter()
    for _ in range(times):
        call()
    host = 1e3 * (time.perf_counter() - start)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end), host


def core_only(args) -> dict:
    """This tree's plain core rows (what `--before` asks another tree's copy of this file for)."""
    runner = load_model_runner(args.target, device=args.device, dtype=bench_dtype(args.device), load_format="dummy")
    return {"core": core_rows(runner, args.batches, args.prompt_len, args.new_tokens)}


def before(args) -> dict | None:
    """The other tree's core rows, from its own copy of this file in a subprocess (its code first on the path)."""
    if args.before is None:
        return None
    tree = args.before.resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))}
    command = [sys.executable, str(tree / "ops/bench/gpu_core_check.py"), "--core-only", "--batches", *map(str, args.batches),
               "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
               "--target", str(args.target.resolve()), "--device", args.device]  # fmt: skip
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(result: dict) -> str:
    lines = ["| what | batch | ms/step | tok/s |", "|---|---|---|---|"]
    for label, rows in (("before: core", (result.get("before") or {}).get("core", [])), ("core", result["core"])):
        for r in rows:
            lines.append(f"| {label} {r['logprobs']} | {r['batch']} | {r['ms_per_step']:.2f} | {r['tok_s']:.0f} |")
    for r in result.get("graph", []):
        lines.append(f"| runner graph q={r['query_len']} | {r['batch']} | {r['graph_ms']:.2f} | |")
    for r in result["dspark"]:
        lines.append(f"| DSpark gamma={r['gamma']} SIMULATED accept {r['simulated_accept_len']} {r['logprobs']} (median of {len(r['rounds'])}) | "
                     f"{r['batch']} | {r['ms_per_step']:.2f} | {r['tok_s']:.0f} |")
    for r in result.get("kernels", []):
        lines.append(f"| kernel {r['kernel']} q={r['query_len']} (err {r['max_abs_err']:.1e}) | {r['batch']} | {r['ms']:.4f} | |")
    for r in result.get("pair", []):
        extra = f" accept {r['accept_len'] or 0:.2f}, same tokens {r['same_tokens_as_plain']:.2f}" if "accept_len" in r else ""
        lines.append(f"| trained pair {r['mode']}{extra} | {r['batch']} | | {r['tok_s']:.0f} |")
    for r in result.get("logprob_path", []):
        lines.append(f"| logprob path alone, top-{r['k']}, {r['rows_per_request']} rows/request: ms back to back; "
                     f"alone {r['alone_ms']:.3f}, host {r['host_ms']:.3f} | {r['batch']} | {r['back_to_back_ms']:.3f} | |")  # fmt: skip
        lines.append(f"| same from graphs ({r['graph_captures']} captured in {r['graph_capture_ms']:.0f} ms; exact: raw "
                     f"{r['graphs_agree_raw']}, processed {r['graphs_agree_processed']}): alone {r['graph_alone_ms']:.3f}, "
                     f"host {r['graph_host_ms']:.3f} | {r['batch']} | {r['graph_back_to_back_ms']:.3f} | |")  # fmt: skip
        lines.append(f"| top_k_sorted vs candidate by running count (agree: {r['top_k_variants_agree']}) | {r['batch']} x "
                     f"{r['rows_per_request']} | {r['top_k_sorted_ms']:.3f} vs {r['top_k_running_count_ms']:.3f} | |")  # fmt: skip
    for r in result.get("top20_cost", []):
        cost = "n/a" if r["top20_cost"] is None else f"{r['top20_cost']:.1%}"
        graphs = ", logprob graphs" if r["logprob_graphs"] else ""
        lines.append(f"| top-20 cost, {r['step']}{graphs} (target <= {r['target']:.0%}) | {r['batch']} | | {cost} |")
    lines.append(f"syncs per decode step with top-20 logprobs (sync debug mode): {result['syncs']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", nargs="*", type=int, default=None, help="default 1 64 (--speedup: 1 16 64)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--simulate-accept-len", type=int, default=4)
    parser.add_argument("--before", type=Path, default=None, help="a checkout of the tree before, to time its core in the same run")
    parser.add_argument("--core-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target", type=Path, default=TARGET, help="target config directory (dummy weights)")
    parser.add_argument("--draft", type=Path, default=DRAFT, help="DSpark draft config directory (dummy weights)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random target and a one-layer dummy drafter for it (smoke)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for the smoke run")
    parser.add_argument("--pair", nargs=2, type=Path, default=None, metavar=("TARGET", "DRAFT"),
                        help="a trained target and its DSpark drafter: accept length and tok/s against plain")
    parser.add_argument("--logprob-cost", action="store_true",
                        help="only the top-20 cost: core and DSpark rows, plain and top-20, the logprob path alone, syncs")
    parser.add_argument("--graphs-first", action="store_true",
                        help="the core's top20_graphs run before top20 (is a difference between them the order?)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per core run, in a rotating order (the median is kept)")
    parser.add_argument("--fused-logprobs", action="store_true",
                        help="raw-mode logprobs from the Triton kernels (triton_logprobs.py) in every core and the path alone (CUDA)")
    parser.add_argument("--speedup", action="store_true",
                        help="only plain against DSpark static and compact at --batches (default 1 16 64), acceptance replayed, "
                             "tok/s at the held batch (and over the drained run)")
    parser.add_argument("--accept-lengths", type=Path, default=None,
                        help="--speedup: a JSON with accept_length_counts (a trained-pair or --pair run's) to replay; "
                             "default geometric, mean ~4")
    parser.add_argument("--budget-s", type=float, default=280, help="--speedup: runs not started by then are skipped")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_core.json")


def main(args: argparse.Namespace) -> int:
    if args.core_only:
        print(json.dumps(core_only(args)))
        return 0
    if not args.tiny:
        return measure(args)
    return harness.on_tiny_pair(args, measure)


def measure(args: argparse.Namespace) -> int:
    args.batches = args.batches or ([1, 16, 64] if args.speedup else [1, 64])
    if args.speedup:
        return measure_speedup(args)
    result = {"device": device_name(args.device), "torch": torch.__version__, "before": None if args.logprob_cost else before(args)}
    runner = load_model_runner(args.target, device=args.device, dtype=bench_dtype(args.device), load_format="dummy", cuda_graphs=False)
    if runner.decode_kernel:
        runner.prepare_decode_graphs(query_lens=(1, 8))
    fused = result["fused_logprobs"] = args.fused_logprobs and runner.device.type == "cuda" and triton_available()
    runs = (LOGPROB_RUNS[0], LOGPROB_RUNS[2], LOGPROB_RUNS[1]) if args.graphs_first else LOGPROB_RUNS
    result["core"] = core_rows(runner, args.batches, args.prompt_len, args.new_tokens, fused, runs, args.rounds)
    if not args.logprob_cost:
        result["graph"] = graph_rows(runner, args.batches, (1, 8))
        result["kernels"] = kernel_rows() if args.device == "cuda" else []
    result["syncs"] = [sync_count(runner, b, graphs, fused) for b in args.batches for graphs in (False, True)]  # top-20 logprobs
    result["dspark"] = dspark_rows(runner, args.draft, args.batches, args.prompt_len, args.new_tokens, args.simulate_accept_len, fused,
                                   args.rounds)  # fmt: skip
    result["top20_cost"] = top20_cost(result)
    result["logprob_path"] = logprob_path_rows(runner, args.batches, result["dspark"][0]["gamma"] + 1, fused=fused)
    if args.pair is not None and not args.logprob_cost:
        result["pair"] = pair_rows(*args.pair, (1, 16), args.new_tokens, args.device)
    write_json(args.out, result)
    print(table(result))
    return 0


KV_BLOCK = 16


def measure_speedup(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.budget_s
    result = {"device": device_name(args.device), "torch": torch.__version__, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "rounds": args.rounds}  # fmt: skip
    # The KV cache holds the largest batch's sequences and no more: sized from free memory it left an
    # 80 GB card too little for the drafter, its graphs and a 64-row verify's activations.
    blocks = 2 * max(args.batches) * -(-(args.prompt_len + args.new_tokens + 64) // KV_BLOCK)
    runner = load_model_runner(args.target, device=args.device, dtype=bench_dtype(args.device), load_format="dummy", cuda_graphs=False,
                               num_kv_blocks=blocks, kv_block_size=KV_BLOCK)  # fmt: skip
    if runner.decode_kernel:
        runner.prepare_decode_graphs(query_lens=(1,))
    speedup(args, runner, result, deadline)
    result["elapsed_s"] = round(args.budget_s - (deadline - time.monotonic()), 1)
    write_json(args.out, result)
    print(speedup_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
