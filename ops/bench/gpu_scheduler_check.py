"""Decode throughput through the scheduler core (batching, sampling, logprobs) on one GPU,
against Hugging Face `transformers` `generate()` on the same dummy model as the peer.

For each model directory (dummy bf16 weights): B requests of `--prompt-len` random tokens each
generate `--new-tokens` greedy tokens through `SchedulerCore.step()` until all finish, without
and with logprobs (top-5 prompt and output). Tokens/s counts generated tokens over the wall time
from the first step to the last. The peer runs `generate(do_sample=False)` with the same batch,
prompt length and token count (min_new_tokens = max_new_tokens, so no early stop).

    python ops/bench/gpu_scheduler_check.py --out $OUT/gpu_scheduler.json
    python ops/bench/gpu_scheduler_check.py --no-peer --compare-overlap --out $OUT/gpu_overlap.json

--compare-overlap adds, per batch, the same runs with overlapped decoding off
(`SchedulerCore(overlap_decode=False)`), one after the other on one runner: rows
"sparkwire_no_overlap" (and "_logprobs"), and ms per decode step of each.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from contracts.scheduler import LogprobParams, SamplingParams
from services.scheduler.build import core_for
from services.scheduler.core import SchedulerCore
from services.scheduler.model.loader import load_model_runner
from services.scheduler.request import SchedulerRequest

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIGS = [REPO / "ops/model_configs" / name for name in ("Qwen3-0.6B", "Qwen3-8B")]
LOGPROBS = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=5)


def make_prompts(batch: int, prompt_len: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, size=(batch, prompt_len), dtype=np.int32)  # [B, P]


def run_core(core: SchedulerCore, prompts: np.ndarray, new_tokens: int, logprobs: LogprobParams) -> dict:
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add(SchedulerRequest(f"r{index}", prompt, "d", sampling, logprobs))
    counts: dict[str, int] = {}
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), 0
    while core.has_work():
        for output in core.step():
            counts[output.rid] = counts.get(output.rid, 0) + len(output.new_token_ids)
        steps += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    assert sorted(counts.values()) == [new_tokens] * len(prompts), counts
    return {"wall_s": wall, "steps": steps, "tok_s": len(prompts) * new_tokens / wall}


def hf_generate(config_dir: Path, prompts: np.ndarray, new_tokens: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).eval()
    ids = torch.as_tensor(prompts, dtype=torch.long, device="cuda")
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    assert out.shape == (len(prompts), prompts.shape[1] + new_tokens)
    del model
    return {"wall_s": wall, "tok_s": len(prompts) * new_tokens / wall}


def bench_config(
    config_dir: Path, batches: list[int], prompt_len: int, new_tokens: int, peer: bool, compare_overlap: bool = False
) -> list[dict]:
    runner = load_model_runner(config_dir, device="cuda", dtype=torch.bfloat16, load_format="dummy")
    rows = []
    settings = {"": True, "_no_overlap": False} if compare_overlap else {"": True}
    for batch in batches:
        row = {"model": config_dir.name, "batch": batch}
        for suffix, overlap in settings.items():
            core = core_for(runner, max_running_requests=max(batches), chunked_prefill_size=8192, overlap_decode=overlap)
            prompts = make_prompts(batch, prompt_len, runner.config.vocab_size)
            # warm-up at the timed shapes, with and without logprobs: the whole batch's prefill and decode (one
            # prompt left the big prefill's first launch inside the timed run: on 2026-12-01 its tok/s came out
            # below the run with logprobs after it; a warm-up without logprobs left the first logprob kernels'
            # loading and compiling in the first setting's logprob run: gpu_overlap.md, runs 1-3)
            run_core(core, prompts, 4, LogprobParams())
            run_core(core, prompts, 4, LOGPROBS)
            row["sparkwire" + suffix] = run_core(core, prompts, new_tokens, LogprobParams())
            row["sparkwire" + suffix + "_logprobs"] = run_core(core, prompts, new_tokens, LOGPROBS)
        rows.append(row)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    if peer:
        for row in rows:
            row["hf_generate"] = hf_generate(config_dir, make_prompts(row["batch"], prompt_len, 151936), new_tokens)
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | sparkwire tok/s | + logprobs (top-5, prompt+output) tok/s | HF generate() tok/s | speedup vs HF |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        hf = r.get("hf_generate", {}).get("tok_s")
        ours = r["sparkwire"]["tok_s"]
        lines.append(f"| {r['model']} | {r['batch']} | {ours:.0f} | {r['sparkwire_logprobs']['tok_s']:.0f} | "
                     f"{hf and f'{hf:.0f}'} | {hf and f'{ours / hf:.1f}x'} |")
    compared = [r for r in rows if "sparkwire_no_overlap" in r]
    if compared:
        lines += ["", "| model | batch | overlap | tok/s | ms per step | + logprobs tok/s |", "|---|---|---|---|---|---|"]
        for r in compared:
            for name, label in (("sparkwire_no_overlap", "off"), ("sparkwire", "on")):
                run, lp = r[name], r[name + "_logprobs"]
                lines.append(f"| {r['model']} | {r['batch']} | {label} | {run['tok_s']:.0f} | "
                             f"{1e3 * run['wall_s'] / run['steps']:.3f} | {lp['tok_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="*", type=Path, default=DEFAULT_CONFIGS)
    parser.add_argument("--batch-sizes", nargs="*", type=int, default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--compare-overlap", action="store_true", help="also time each batch with overlapped decoding off")
    parser.add_argument("--out", type=Path, default=REPO / "ops/bench/results/gpu_scheduler.json")
    args = parser.parse_args()
    rows = []
    for config_dir in args.configs:
        try:
            rows += bench_config(config_dir, args.batch_sizes, args.prompt_len, args.new_tokens, not args.no_peer, args.compare_overlap)
        except Exception:
            traceback.print_exc()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
