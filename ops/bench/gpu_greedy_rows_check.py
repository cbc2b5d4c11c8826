"""`LogprobGraphs.greedy` on the GPU: a plain greedy decode step whose every request asks for output
logprobs, through `SchedulerCore` built as the stack builds it (`service.build_core`), with the
greedy path on (one graph over the decode graph's logits, argmax included, one readback span)
against off (the worker's `_verify` argmax, then `LogprobGraphs.compute`: what main did before).

Per batch and logprob setting: whether both give the same tokens and logprob arrays, bit for bit;
ms per step and the step loop's host ms per decode step (its `core.step` wall time less its wait
for the readback, as `gpu_step_profile.py` counts it), medians over alternating rounds; how many
decode steps' readbacks needed a concatenation.

    PYTHONPATH=. python ops/bench/gpu_greedy_rows_check.py --model ops/model_configs/Qwen3-0.6B --out $OUT/greedy_rows.json
    PYTHONPATH=. python ops/bench/gpu_greedy_rows_check.py --device cpu --out /tmp/greedy_rows.json  # smoke (tiny model, twins)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from contracts.scheduler import LogprobParams, SamplingParams
from services.models import RANDOM_TINY_MODEL
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import SchedulerRequest
from services.scheduler.build import build_core

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {
    "top20": LogprobParams(return_logprob=True, top_logprobs_num=20),
    "top5_ids4": LogprobParams(return_logprob=True, top_logprobs_num=5, token_ids_logprob=(7, 3, 1999, 11)),
}
ARRAYS = ("output_token_logprobs", "output_top_logprobs", "output_top_ids", "output_ids_logprobs")


def decode(core, batch: int, new_tokens: int, logprobs: LogprobParams, seed: int) -> tuple[dict, list[float], list[float]]:
    """Every request's tokens and output logprob arrays; each decode step's wall and host seconds."""
    vocab = core.vocab_size
    prompts = np.random.default_rng(seed).integers(0, vocab, size=(batch, 128), dtype=np.int32)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add(SchedulerRequest(f"r{index}", prompt, "d", sampling, logprobs))
    results: dict[str, dict[str, list]] = {}
    walls, hosts = [], []
    while core.has_work():
        begin = time.perf_counter()
        outputs = core.step()
        wall = time.perf_counter() - begin
        record = core.last_step
        if record is not None and record.num_prefill_tokens == 0:
            walls.append(wall)
            hosts.append(wall - record.collect_s)
        for out in outputs:
            entry = results.setdefault(out.rid, {"tokens": [], **{name: [] for name in ARRAYS}})
            entry["tokens"] += out.new_token_ids
            for name in ARRAYS:
                value = getattr(out.logprobs, name) if out.logprobs is not None else None
                if value is not None:
                    entry[name].append(value)
    return results, walls, hosts


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for rid, entry in a.items():
        other = b[rid]
        if entry["tokens"] != other["tokens"]:
            return False
        for name in ARRAYS:
            if len(entry[name]) != len(other[name]):
                return False
            if entry[name] and not np.array_equal(np.concatenate(entry[name]), np.concatenate(other[name])):
                return False
    return True


def measure(core, batch: int, new_tokens: int, logprobs: LogprobParams, rounds: int, sync) -> dict:
    worker = core.worker

    def run(on: bool, seed: int):
        worker.greedy_logprob_graphs = on
        joined = worker._readback.num_joined
        out = decode(core, batch, new_tokens, logprobs, seed)
        sync()
        return out, worker._readback.num_joined - joined

    run(True, 0), run(False, 0)  # warm-up: graphs of both paths captured at these shapes
    times: dict[str, dict[str, list[float]]] = {"on": {"ms": [], "host_ms": []}, "off": {"ms": [], "host_ms": []}}
    agree, joined = True, {"on": 0, "off": 0}
    for index in range(rounds):
        outs = {}
        for name in (("on", "off") if index % 2 == 0 else ("off", "on")):
            (results, walls, hosts), num_joined = run(name == "on", seed=index + 1)
            outs[name] = results
            times[name]["ms"].append(1e3 * statistics.median(walls))
            times[name]["host_ms"].append(1e3 * statistics.median(hosts))
            joined[name] += num_joined
        agree &= same(outs["on"], outs["off"])
    worker.greedy_logprob_graphs = True
    row = {"batch": batch, "new_tokens": new_tokens, "identical": agree, "rounds": rounds}
    for name in ("on", "off"):
        row[f"ms_per_step_{name}"] = round(statistics.median(times[name]["ms"]), 4)
        row[f"host_ms_per_step_{name}"] = round(statistics.median(times[name]["host_ms"]), 4)
        row[f"joined_readbacks_{name}"] = joined[name]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "ops/model_configs/Qwen3-0.6B", help="config directory (dummy weights)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the tiny model's twins (smoke)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 3, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "ops/bench/results/gpu_greedy_rows.json")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    model = args.model if cuda else RANDOM_TINY_MODEL
    config = SchedulerConfig(model=str(model), device=args.device, load_format="dummy", max_running_requests=max(args.batches),
                             greedy_logprob_graphs=True)  # fmt: skip
    core = build_core(config)
    if not cuda:  # the twins the CPU tests run: decode graphs' and logprob graphs' padded eager paths
        from services.scheduler.logprob_graphs import LogprobGraphs

        core.worker.runner.prepare_decode_graphs(ladder=(1, 2, 4, 8, 16, 32, 64), max_blocks_per_seq=16, capture=False)
        core.worker.logprob_graphs = LogprobGraphs(core.worker._top_k_keys, capture=False)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for setting, logprobs in SETTINGS.items():
        for batch in args.batches:
            rows.append({"logprobs": setting, **measure(core, batch, args.new_tokens if cuda else 6, logprobs, args.rounds, sync)})
    result = {"model": str(model), "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows,
              "greedy_graphs": sum(1 for key in core.worker.logprob_graphs._graphs if key.source)}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("| logprobs | batch | identical | ms/step on / off | host ms/step on / off | joined readbacks on / off |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['logprobs']} | {r['batch']} | {r['identical']} | {r['ms_per_step_on']} / {r['ms_per_step_off']} | "
              f"{r['host_ms_per_step_on']} / {r['host_ms_per_step_off']} | {r['joined_readbacks_on']} / {r['joined_readbacks_off']} |")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
