"""The figures of one `sparkwire bench serve` run, with the meanings `vllm bench serve` and
`sglang.bench_serving` give them (client-side times, failed requests left out of every latency):

- TTFT: from sending the request to the first event that carries a token.
- ITL: the gap between consecutive token-carrying events; an event that carries n tokens (a
  speculative step, a batch of the detokenizer) counts as n gaps of 1/n of it each. Tokens that
  come with the first event have no gap. So a request's gaps add up to its last token's arrival
  minus its TTFT.
- TPOT: (e2e - TTFT) / (output tokens - 1), per request (requests of one token have none).
- E2E: from sending the request to the end of its stream.
- Throughputs divide by the duration: from the first request sent to the last one finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ops.bench.serve_client import RequestRecord

PERCENTILES = (50, 90, 99)
MS = 1000.0
ERRORS_KEPT = 5  # distinct error messages in the results; the count has them all


def inter_token_latencies(record: RequestRecord) -> list[float]:
    """Seconds; len = output tokens after the first event's."""
    gaps: list[float] = []
    for previous, now, tokens in zip(record.chunk_times, record.chunk_times[1:], record.chunk_tokens[1:]):
        gaps += [(now - previous) / tokens] * tokens
    return gaps


def time_per_output_token(record: RequestRecord) -> float | None:
    if record.output_tokens < 2:
        return None
    return (record.e2e - record.ttft) / (record.output_tokens - 1)


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean / std / min / p50 / p90 / p99 / max in milliseconds (None for an empty list)."""
    names = ("mean", "std", "min", *(f"p{p}" for p in PERCENTILES), "max")
    if not values_s:
        return dict.fromkeys(names)
    ms = np.asarray(values_s, dtype=np.float64) * MS
    figures = [ms.mean(), ms.std(), ms.min(), *np.percentile(ms, PERCENTILES), ms.max()]
    return {name: float(value) for name, value in zip(names, figures, strict=True)}


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    total_in, total_out = sum(r.prompt_tokens for r in done), sum(r.output_tokens for r in done)
    tpots = [t for r in done if (t := time_per_output_token(r)) is not None]
    return {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if not r.ok})[:ERRORS_KEPT],
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "output_len_mismatches": sum(r.output_tokens != r.prompt.output_len for r in done),
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "mean_concurrency": sum(r.e2e for r in done) / duration_s,  # requests in flight, on average
        "ttft_ms": distribution([r.ttft for r in done]),
        "itl_ms": distribution([gap for r in done for gap in inter_token_latencies(r)]),
        "tpot_ms": distribution(tpots),
        "e2el_ms": distribution([r.e2e for r in done]),
    }


def per_request(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """One row per request, in sending order, for checking the summary and for plots."""
    return [
        {"ok": r.ok, "error": r.error or None, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
         "asked_output_tokens": r.prompt.output_len, "ttft_s": r.ttft, "e2e_s": r.e2e, "num_events": len(r.chunk_times),
         "last_token_s": r.chunk_times[-1] if r.chunk_times else None, "itl_sum_s": sum(inter_token_latencies(r)),
         "sent_at": r.sent_at}
        for r in records
    ]  # fmt: skip


def table(results: dict[str, Any]) -> str:
    """A short markdown table of one run."""
    rows = [
        ("requests ok / failed", f"{results['completed']} / {results['failed']}"),
        ("duration s", f"{results['duration_s']:.2f}"),
        ("request/s", f"{results['request_throughput']:.2f}"),
        ("output tok/s", f"{results['output_throughput']:.1f}"),
        ("total tok/s", f"{results['total_token_throughput']:.1f}"),
        ("benchmark client CPU (fraction of one core)", f"{results.get('client_cpu_fraction', 0.0):.2f}"),
        *((f"{name} ms mean / p50 / p90 / p99", _latency_cell(results[f"{name.lower()}_ms"]))
          for name in ("TTFT", "ITL", "TPOT", "E2EL")),
    ]  # fmt: skip
    return "\n".join(["| figure | value |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])


def _latency_cell(figures: dict[str, float | None]) -> str:
    values = [figures[key] for key in ("mean", "p50", "p90", "p99")]
    return " / ".join("-" if value is None else f"{value:.2f}" for value in values)
