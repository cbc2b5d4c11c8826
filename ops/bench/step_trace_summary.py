"""Where a scheduler's time went, from its step trace (`sparkwire scheduler --step-trace DIR`).

Each step is one of:
- `decode`: no prompt token, every sequence decodes (or verifies), split by whether it was launched
  before the step ahead was read back (`followed`, overlapped decoding) or not;
- `mixed`: prompt chunks beside decodes;
- `prefill`: prompt chunks alone;
- `idle`: a step that planned nothing (finishes handed on).
Per kind: steps, wall seconds and their share of the window, ms per step, sequences and tokens per
step, how long collecting its results took (`collect_s`) and, of that, how long the host waited
for the device (`wait_s`; a trace from before it was recorded: `collect_s` stands in), the step
less that wait (`host_ms`: the step thread's own time a step, GIL waits included; it tells trees
apart where the device sets the pace and the step's wall cannot), and
the share of steps whose readback was back before the host asked for it (`host_late_share`, a
wait under 0.05 ms: the device had finished the step and idled for the host, for how long the
trace cannot say). Between steps the thread waited
`turn_s`: `held` when the event loop had not published the step ahead yet, else for work. What is
left of the window (`between_steps_s`: the span less the steps and the turns after the first) is
the thread's own time between steps: handing the outputs over, the trace line, and waiting there
for the GIL while the event loop publishes. The decode batch is weighted by time: a decode step of fewer
sequences than the concurrency serves fewer tokens for the same weights read; so is `running`
(the scheduler's running requests after each step, over every step). `queue_ms`: the requests
first scheduled in the window, from their arrival at the scheduler until then (`admitted` of them).

    sparkwire bench step-trace TRACE.jsonl [--window START END]  # time.monotonic() seconds
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ops.bench.common import script

KINDS = ("decode_followed", "decode", "mixed", "prefill", "idle")
HOST_LATE_S = 5e-5  # a readback wait under this: the step's results were back before the host asked


def read_trace(path: Path, window: tuple[float, float] | None = None) -> list[dict]:
    """A trace's lines (a `.gz` file: gunzipped), those that began in `window` where given."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    return lines if window is None else in_window(lines, *window)


def in_window(lines: list[dict], start: float, end: float) -> list[dict]:
    """The lines of the steps that began from `start` to `end` (time.monotonic() seconds)."""
    return [line for line in lines if start <= line["t"] <= end]


def kind_of(line: dict) -> str:
    if "num_seqs" not in line:
        return "idle"
    if line["num_prefill_tokens"] == 0:
        return "decode_followed" if line["followed"] else "decode"
    return "mixed" if line["num_tokens"] > line["num_prefill_tokens"] else "prefill"


def summarize(lines: Iterable[dict]) -> dict[str, Any]:
    lines = list(lines)
    if not lines:
        return {"num_steps": 0}
    span = lines[-1]["t"] + lines[-1]["dur_s"] - lines[0]["t"]
    kinds: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        chosen = [line for line in lines if kind_of(line) == kind]
        if not chosen:
            continue
        seconds = sum(line["dur_s"] for line in chosen)
        row = {"steps": len(chosen), "seconds": seconds, "share": seconds / span, "ms_per_step": 1e3 * seconds / len(chosen)}
        if kind != "idle":
            row |= {name: sum(line[key] for line in chosen) / len(chosen) for name, key in
                    (("seqs", "num_seqs"), ("tokens", "num_tokens"), ("prefill_tokens", "num_prefill_tokens"),
                     ("collect_ms", "collect_s"))}  # fmt: skip
            row["collect_ms"] *= 1e3
            waits = [line.get("wait_s", line["collect_s"]) for line in chosen]
            row["wait_ms"] = 1e3 * sum(waits) / len(chosen)
            row["host_ms"] = row["ms_per_step"] - row["wait_ms"]
            row["host_late_share"] = sum(wait < HOST_LATE_S for wait in waits) / len(chosen)
            row |= _host_spread(chosen, waits)
        kinds[kind] = row
    decodes = [line for line in lines if kind_of(line).startswith("decode")]
    decode_s = sum(line["dur_s"] for line in decodes)
    busy = sum(line["dur_s"] for line in lines)
    queued_ms = [1e3 * seconds for line in lines for seconds in line.get("queued_s", ())]
    return {
        "num_steps": len(lines),
        "span_s": span,
        "busy_s": busy,
        "between_steps_s": span - busy - sum(line["turn_s"] for line in lines[1:]),  # the first turn came before the span
        "held_s": sum(line["turn_s"] for line in lines if line["held"]),
        "waited_for_work_s": sum(line["turn_s"] for line in lines if not line["held"]),
        "decode_batch_time_weighted": sum(line["num_seqs"] * line["dur_s"] for line in decodes) / decode_s if decode_s else None,
        "running_time_weighted": sum(line["running"] * line["dur_s"] for line in lines) / busy if busy else None,
        "admitted": len(queued_ms),
        "queue_ms": _spread_ms(queued_ms) if queued_ms else None,
        "kinds": kinds,
    }


def _spread_ms(values: list[float]) -> dict[str, float]:
    deciles = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else values * 9
    return {"mean": statistics.fmean(values), "p50": statistics.median(values), "p90": deciles[8], "max": max(values)}


def _host_spread(chosen: list[dict], waits: list[float]) -> dict[str, float | None]:
    """The host's time a step at its median and 90th percentile, and the mean wall of the steps the
    host was late for (the device idled) against the others' (JSON only)."""
    hosts = [1e3 * (line["dur_s"] - wait) for line, wait in zip(chosen, waits, strict=True)]
    late = [1e3 * line["dur_s"] for line, wait in zip(chosen, waits, strict=True) if wait < HOST_LATE_S]
    waited = [1e3 * line["dur_s"] for line, wait in zip(chosen, waits, strict=True) if wait >= HOST_LATE_S]
    spread = _spread_ms(hosts)
    return {"host_ms_p50": spread["p50"], "host_ms_p90": spread["p90"],
            "late_ms_per_step": statistics.fmean(late) if late else None,
            "waited_ms_per_step": statistics.fmean(waited) if waited else None}


def table(summary: dict[str, Any]) -> str:
    if not summary.get("num_steps"):
        return "no steps in the window"
    lines = [f"{summary['num_steps']} steps over {summary['span_s']:.3f} s: busy {summary['busy_s']:.3f} s, "
             f"held by publishing {summary['held_s']:.3f} s, waiting for work {summary['waited_for_work_s']:.3f} s, "
             f"between steps {summary['between_steps_s']:.3f} s; "
             f"decode batch (time-weighted) {summary['decode_batch_time_weighted'] or 0:.1f}"
             + (f"; {summary['admitted']} admitted, queued {summary['queue_ms']['mean']:.2f} ms mean, "
                f"{summary['queue_ms']['p90']:.2f} p90" if summary.get("queue_ms") else ""),
             "| kind | steps | s | share | ms/step | seqs | tokens | prefill tokens | wait ms | host ms | host late |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for kind, row in summary["kinds"].items():
        extra = " | ".join(f"{row[k]:.1f}" for k in ("seqs", "tokens", "prefill_tokens")) if "seqs" in row else " | |"
        extra += f" | {row['wait_ms']:.2f} | {row['host_ms']:.2f} | {row['host_late_share']:.2f}" if "seqs" in row else " | | |"
        lines.append(f"| {kind} | {row['steps']} | {row['seconds']:.3f} | {row['share']:.2f} | {row['ms_per_step']:.2f} | {extra} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", type=Path, help="a scheduler's trace file (<instance>.jsonl in its --step-trace directory)")
    parser.add_argument("--window", type=float, nargs=2, metavar=("START", "END"), default=None)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    summary = summarize(read_trace(args.trace, tuple(args.window) if args.window else None))
    print(json.dumps(summary, indent=2) if args.json else table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
