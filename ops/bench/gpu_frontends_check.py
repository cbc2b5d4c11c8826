"""Issue 12, point 1: is the front end what keeps the stack under 0.9x the core at concurrency 64?

Between waves of the closed loop the tokenizer takes each burst of finishes and new requests one
request at a time (~1.1 ms of its CPU per request on a 2-core box, most of it Litestar's request
handling), while the scheduler decodes what is left at a small batch (gpu_serve.md, runs 23 and
26). This runs the same concurrency-64 scenario as `gpu_serve_check.py`:

- `one front end`: every request through `sparkwire up`'s tokenizer;
- `two front ends`: half of the concurrency through it, half through a second `sparkwire tokenizer`
  on a port of its own, on the same NATS server (one `bench serve` client per front end, both in
  one event loop; output tok/s = every token over the longer of the two runs),

alternating, `--repeats` times each, after the core's batch-64 figure (`gpu_scheduler_check.py`).
`sparkwire up` gets `--nats-url` of a nats-server started here, so the second tokenizer can join.

    PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:. python3 ops/bench/gpu_frontends_check.py --out $OUT/gpu_frontends.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import uvloop

from ops.bench.gpu_serve_check import CheckConfig, core_baseline, serving_model_dir
from ops.bench.serve import ServeConfig, benchmark
from ops.bench.serve_launch import LoggedProcess, health_ok, launched_stack
from services.common.nats_server import free_port, start_nats_server

REPO = Path(__file__).resolve().parents[2]


async def split_run(urls: list[str], check: CheckConfig, num_prompts: int) -> dict:
    """num_prompts at concurrency `check.concurrency`, split evenly over the front ends at `urls`."""
    share = check.concurrency // len(urls)
    configs = [ServeConfig(base_url=url, num_prompts=num_prompts // len(urls), input_len=check.input_len, output_len=check.output_len,
                           ignore_eos=True, max_concurrency=share, num_warmups=share, progress=False, seed=i)
               for i, url in enumerate(urls)]  # fmt: skip
    results = await asyncio.gather(*(benchmark(c) for c in configs))
    tokens, duration = sum(r["total_output_tokens"] for r in results), max(r["duration_s"] for r in results)
    return {"front_ends": len(urls), "output_throughput": tokens / duration, "duration_s": duration,
            "failed": sum(r["failed"] for r in results), "ttft_p50_ms": [r["ttft_ms"]["p50"] for r in results],
            "itl_p50_ms": [r["itl_ms"]["p50"] for r in results]}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    check = CheckConfig(model_config=args.model_config, device=args.device, concurrency=args.concurrency, input_len=args.input_len,
                        output_len=args.output_len)  # fmt: skip
    result: dict = {"concurrency": check.concurrency, "num_prompts": args.num_prompts, "runs": []}
    with tempfile.TemporaryDirectory(prefix="sparkwire-frontends-") as tmp:
        work = Path(tmp)
        result["core_baseline"] = core_baseline(check, work) if not args.no_core_baseline and args.device == "cuda" else None
        model_dir = serving_model_dir(check.model_config, work / "model")
        nats = start_nats_server()  # the project's config: no users, so a second tokenizer can join
        base = f"http://127.0.0.1:{free_port()}"
        up_args = ("--device", args.device, "--load-format", "dummy", "--model", str(model_dir), "--nats-url", nats.url)
        try:
            with launched_stack(up_args, base, args.out.with_name(args.out.stem + "_up.log")):
                second_port = free_port()
                tokenizer = LoggedProcess.start("tokenizer-2", [sys.executable, "-m", "services.cli", "tokenizer", "--nats-url", nats.url,
                                                                "--port", str(second_port), "--model", str(model_dir)],
                                                args.out.with_name(args.out.stem + "_tokenizer2.log"))  # fmt: skip
                second = f"http://127.0.0.1:{second_port}"
                try:
                    tokenizer.wait_until(lambda: health_ok(second), 120, "the second tokenizer's /health not 200")
                    for _ in range(args.repeats):
                        for urls in ([base], [base, second]):
                            result["runs"].append(uvloop.run(split_run(urls, check, args.num_prompts)))
                finally:
                    tokenizer.stop(30)
        finally:
            nats.stop()
    core = (result["core_baseline"] or {}).get("tok_s")
    for r in result["runs"]:
        r["stack_vs_core"] = r["output_throughput"] / core if core else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"core at batch {check.concurrency}: {core} tok/s")
    print("| front ends | output tok/s | stack / core | TTFT p50 ms | ITL p50 ms | failed |\n|---|---|---|---|---|---|")
    for r in result["runs"]:
        ratio = "-" if r["stack_vs_core"] is None else f"{r['stack_vs_core']:.3f}"
        print(f"| {r['front_ends']} | {r['output_throughput']:.0f} | {ratio} | {r['ttft_p50_ms']} | {r['itl_p50_ms']} | {r['failed']} |")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", type=Path, default=CheckConfig.model_config)
    parser.add_argument("--device", default="cuda", help="cuda; cpu for the smoke test")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-core-baseline", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "ops/bench/results/gpu_frontends.json")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
