"""What observing one request's inter-token gaps costs the tokenizer (`Metrics.observe_request`):
prometheus_client's `Histogram`, one `labels(...).observe(gap)` per gap (what the tokenizer did),
against `BulkHistogram.observe_many` (one numpy pass), for a request of `--tokens` tokens; and that
both expose the same buckets, count and sum.

    python -m ops.bench.metrics_cost --out ops/bench/results/metrics_cost.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, Histogram

from services.common.metrics import INTER_TOKEN_BUCKETS, BulkHistogram


def per_request_us(observe, gaps: list[float], repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        observe(gaps)
    return 1e6 * (time.perf_counter() - start) / repeats


def samples(registry: CollectorRegistry) -> dict[str, float]:
    return {f"{s.name}{sorted(s.labels.items())}": s.value for m in registry.collect() for s in m.samples if not s.name.endswith("_created")}


def run(args: argparse.Namespace) -> dict:
    gaps = np.random.default_rng(0).exponential(0.006, args.tokens - 1).tolist()
    before_registry, after_registry = CollectorRegistry(), CollectorRegistry()
    before = Histogram("itl", "gaps", ["model_name"], buckets=INTER_TOKEN_BUCKETS, registry=before_registry)
    after = BulkHistogram("itl", "gaps", {"model_name": "m"}, INTER_TOKEN_BUCKETS)
    after_registry.register(after)

    def one_by_one(values: list[float]) -> None:
        for gap in values:
            before.labels("m").observe(gap)

    result = {"tokens": args.tokens, "repeats": args.repeats,
              "histogram_us": per_request_us(one_by_one, gaps, args.repeats),
              "bulk_histogram_us": per_request_us(after.observe_many, gaps, args.repeats)}  # fmt: skip
    want, got = samples(before_registry), samples(after_registry)  # sums: the same values added in another order
    result["same_exposition"] = want.keys() == got.keys() and all(np.isclose(want[k], got[k], rtol=1e-9, atol=0) for k in want)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"a {args.tokens}-token request's gaps: Histogram {result['histogram_us']:.0f} us, "
          f"BulkHistogram {result['bulk_histogram_us']:.1f} us; same exposition: {result['same_exposition']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
