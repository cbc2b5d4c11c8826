"""What one /metrics page for several tokenizers costs (services/common/metrics_shared.py): a
tokenizer's periodic publish (its registry to a snapshot file), and a scrape (publish, then read
and sum every tokenizer's snapshot), against rendering one registry as before. Nothing here is
on a request's path: requests count into their own process's registry exactly as before.

Each tokenizer's registry is filled as a busy one's is: every route and status seen, requests of
every outcome, inter-token gaps.

    sparkwire bench metrics-shared --out ops/bench/results/metrics_shared_cost.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from services.common.metrics import render
from services.common.metrics_shared import SharedMetricsDir
from services.tokenizer.metrics import Metrics

ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/health", "/metrics", "/tokenize", "<unmatched>")
STATUSES = (200, 400, 404, 499, 503)
OUTCOMES = ("stop", "length", "abort", "error")


def busy_tokenizer(instance: int, directory: Path) -> Metrics:
    rng = random.Random(instance)
    metrics = Metrics("model")
    for route in ROUTES:
        for status in STATUSES:
            metrics.observe_http(route, "POST", status, rng.random())
    for outcome in OUTCOMES:
        metrics.requests_finished.labels("model", outcome).inc(rng.randrange(1, 1000))
    for histogram in (metrics.ttft, metrics.e2e, metrics.placement, metrics.prompt_len, metrics.generation_len):
        histogram.labels("model").observe(rng.random())
    metrics.itl.observe_many([rng.random() * 0.05 for _ in range(1000)])
    metrics.shared = SharedMetricsDir(metrics.registry, directory, f"tok-{instance}")
    return metrics


def median_us(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e6 * sorted(times)[len(times) // 2]


def run(args: argparse.Namespace) -> dict:
    result: dict = {"repeats": args.repeats, "by_tokenizers": {}}
    for count in args.tokenizers:
        with tempfile.TemporaryDirectory() as directory:
            tokenizers = [busy_tokenizer(i, Path(directory)) for i in range(count)]
            for metrics in tokenizers:
                metrics.shared.publish()
            first = tokenizers[0]
            result["by_tokenizers"][count] = {
                "render_own_registry_us": median_us(lambda: render(first.registry), args.repeats),
                "publish_us": median_us(first.shared.publish, args.repeats),
                "scrape_us": median_us(first.render, args.repeats),
                "page_bytes": len(first.render()),
                "snapshot_bytes": (Path(directory) / "tok-0.msgpack").stat().st_size,
            }
    for count, row in result["by_tokenizers"].items():
        print(f"{count} tokenizers: scrape {row['scrape_us']:.0f} us (one registry alone {row['render_own_registry_us']:.0f} us), "
              f"publish {row['publish_us']:.0f} us a second per tokenizer, page {row['page_bytes']} B")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizers", type=int, nargs="+", default=[1, 3, 4])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
