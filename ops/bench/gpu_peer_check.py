"""Decode throughput through the scheduler core (batching, sampling, logprobs) against its peer,
Hugging Face `transformers` `generate()` on the same dummy model, and against its limit, the HBM
roofline (PRODUCT.md section 9), in one run on one GPU.

For each model directory (dummy bf16 weights): B requests of `--prompt-len` random tokens each
generate `--new-tokens` greedy tokens through the core until all finish, without and with
logprobs (top-5 prompt and output). Tokens/s counts generated tokens over the wall time from the
first step to the last. The peer runs `generate(do_sample=False)` with the same batch, prompt
length and token count (min_new_tokens = max_new_tokens, so no early stop). The roofline floor of
a decode step is the weight bytes it reads (every parameter; the input embedding only where it is
the LM head) over the device-to-device copy bandwidth measured in the same run.

    sparkwire bench gpu-peer --out $OUT/gpu_peer.json
    sparkwire bench gpu-peer --no-peer --compare-overlap --out $OUT/gpu_peer_overlap.json
    sparkwire bench gpu-peer --device cpu --tiny --out /tmp/peer.json   # smoke: the tiny model, fp32

--compare-overlap adds, per batch, the same runs with overlapped decoding off (`overlap_decode`),
one after the other on one runner: rows "sparkwire_no_overlap" (and "_logprobs"), and ms per
decode step of each.
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from contracts.scheduler import LogprobParams, SamplingParams
from ops.bench import scheduler_harness as harness
from ops.bench.common import (
    MODEL_CONFIGS, RESULTS, TINY_MODEL, bench_dtype, copy_bandwidth_gb_s, decode_weight_bytes, device_name, script, synchronize,
    write_json,
)  # fmt: skip
from services.scheduler.model.loader import load_model_runner

DEFAULT_CONFIGS = [MODEL_CONFIGS / name for name in ("Qwen3-0.6B", "Qwen3-8B")]
LOGPROBS = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=5)


def make_prompts(batch: int, prompt_len: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, size=(batch, prompt_len), dtype=np.int32)  # [B, P]


def run_core(core, prompts: np.ndarray, new_tokens: int, logprobs: LogprobParams) -> dict:
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add(harness.new_request(f"r{index}", prompt, sampling, logprobs))
    counts: dict[str, int] = {}
    device = harness.runner_of(core).device.type
    synchronize(device)
    start, steps = time.perf_counter(), 0
    while core.has_work():
        for output in core.step():
            counts[output.rid] = counts.get(output.rid, 0) + len(output.new_token_ids)
        steps += 1
    synchronize(device)
    wall = time.perf_counter() - start
    assert sorted(counts.values()) == [new_tokens] * len(prompts), counts
    return {"wall_s": wall, "steps": steps, "tok_s": len(prompts) * new_tokens / wall}


def hf_generate(config_dir: Path, prompts: np.ndarray, new_tokens: int, device: str) -> dict:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:  # the peer is optional: the core's figures stand without it
        return {"unavailable": f"transformers: {exc}"}
    config = AutoConfig.from_pretrained(config_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=bench_dtype(device)).eval()
    ids = torch.as_tensor(prompts, dtype=torch.long, device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    synchronize(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    synchronize(device)
    wall = time.perf_counter() - start
    assert out.shape == (len(prompts), prompts.shape[1] + new_tokens)
    del model
    return {"wall_s": wall, "tok_s": len(prompts) * new_tokens / wall}


def bench_config(config_dir: Path, args: argparse.Namespace, bandwidth_gb_s: float) -> tuple[list[dict], dict]:
    """(a row per batch: core, core with logprobs, [overlap off], the peer; the model's roofline)."""
    runner = load_model_runner(config_dir, device=args.device, dtype=bench_dtype(args.device), load_format="dummy")
    vocab, weight_bytes = runner.config.vocab_size, decode_weight_bytes(runner)
    rows = [core_row(runner, config_dir, batch, args) for batch in args.batch_sizes]
    del runner
    _free(args.device)
    if not args.no_peer:
        for row in rows:
            row["hf_generate"] = hf_generate(config_dir, make_prompts(row["batch"], args.prompt_len, vocab), args.new_tokens, args.device)
            _free(args.device)
    return rows, roofline(config_dir.name, weight_bytes, bandwidth_gb_s, rows)


def core_row(runner, config_dir: Path, batch: int, args: argparse.Namespace) -> dict:
    row = {"model": config_dir.name, "batch": batch}
    settings = {"": True, "_no_overlap": False} if args.compare_overlap else {"": True}
    for suffix, overlap in settings.items():
        core = harness.core_for(runner, max_running_requests=max(args.batch_sizes), chunked_prefill_size=8192, overlap_decode=overlap)
        prompts = make_prompts(batch, args.prompt_len, runner.config.vocab_size)
        # warm-up at the timed shapes, with and without logprobs: the whole batch's prefill and decode
        # (one prompt left the big prefill's first launch, and the first logprob kernels' loading,
        # inside the timed runs)
        run_core(core, prompts, 4, LogprobParams())
        run_core(core, prompts, 4, LOGPROBS)
        row["sparkwire" + suffix] = run_core(core, prompts, args.new_tokens, LogprobParams())
        row["sparkwire" + suffix + "_logprobs"] = run_core(core, prompts, args.new_tokens, LOGPROBS)
    return row


def roofline(model: str, weight_bytes: int, bandwidth_gb_s: float, rows: list[dict]) -> dict:
    """The decode step's HBM floor (None off CUDA: no bandwidth measured) and the core's batch-1 step against it."""
    floor_ms = weight_bytes / bandwidth_gb_s / 1e6 if bandwidth_gb_s else None
    batch1 = next((r["sparkwire"] for r in rows if r["batch"] == 1), None)
    step_ms = 1e3 * batch1["wall_s"] / batch1["steps"] if batch1 else None
    return {"model": model, "weight_gb": round(weight_bytes / 1e9, 3), "copy_gb_s": round(bandwidth_gb_s, 1),
            "floor_ms": floor_ms and round(floor_ms, 3), "batch1_ms_per_step": step_ms and round(step_ms, 3),
            "batch1_of_floor": round(floor_ms / step_ms, 3) if floor_ms and step_ms else None}  # fmt: skip


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def table(result: dict) -> str:
    lines = ["| model | batch | sparkwire tok/s | + logprobs (top-5, prompt+output) tok/s | HF generate() tok/s | speedup vs HF |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        hf = r.get("hf_generate", {}).get("tok_s")
        ours = r["sparkwire"]["tok_s"]
        lines.append(f"| {r['model']} | {r['batch']} | {ours:.0f} | {r['sparkwire_logprobs']['tok_s']:.0f} | "
                     f"{hf and f'{hf:.0f}'} | {hf and f'{ours / hf:.1f}x'} |")
    lines += ["", "| model | weight GB a step | copy GB/s | HBM floor ms | batch-1 ms/step | floor / step |", "|---|---|---|---|---|---|"]
    for r in result["roofline"]:
        lines.append(f"| {r['model']} | {r['weight_gb']} | {r['copy_gb_s']} | {r['floor_ms']} | {r['batch1_ms_per_step']} | {r['batch1_of_floor']} |")
    compared = [r for r in result["rows"] if "sparkwire_no_overlap" in r]
    if compared:
        lines += ["", "| model | batch | overlap | tok/s | ms per step | + logprobs tok/s |", "|---|---|---|---|---|---|"]
        for r in compared:
            for name, label in (("sparkwire_no_overlap", "off"), ("sparkwire", "on")):
                run, lp = r[name], r[name + "_logprobs"]
                lines.append(f"| {r['model']} | {r['batch']} | {label} | {run['tok_s']:.0f} | "
                             f"{1e3 * run['wall_s'] / run['steps']:.3f} | {lp['tok_s']:.0f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", nargs="*", type=Path, default=DEFAULT_CONFIGS)
    parser.add_argument("--device", default="cuda", help="cuda; cpu for the smoke run (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random model only (smoke)")
    parser.add_argument("--batch-sizes", nargs="*", type=int, default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--compare-overlap", action="store_true", help="also time each batch with overlapped decoding off")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_peer.json")


def main(args: argparse.Namespace) -> int:
    configs = [TINY_MODEL] if args.tiny else args.configs
    bandwidth = copy_bandwidth_gb_s(args.device)
    result: dict = {"device": device_name(args.device), "torch": torch.__version__, "rows": [], "roofline": [], "errors": {}}
    for config_dir in configs:
        try:
            rows, floor = bench_config(config_dir, args, bandwidth)
            result["rows"] += rows
            result["roofline"].append(floor)
        except Exception:  # one bad config must not hide the others' numbers
            result["errors"][config_dir.name] = traceback.format_exc()[-3000:]
        write_json(args.out, result)  # each config kept as it comes
    print(table(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
