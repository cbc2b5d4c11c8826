"""DSpark through the whole stack: `sparkwire bench serve` at concurrency 1, 16 and 64 against a
scheduler decoding plainly, with DSpark `static`, and with DSpark `compact`, in one run.

One nats-server, one detokenizer and one tokenizer (`sparkwire detokenizer` / `tokenizer`) stay up;
the scheduler is started once per mode on the shape's config with dummy weights (default the
Qwen3-8B shape and its dummy drafter, `ops/model_configs/Qwen3-8B-dspark`), as `sparkwire
scheduler` builds it, except that DSpark's acceptance is REPLAYED: every verify keeps a length
drawn per request and per step from `--accept-lengths` (a JSON with `accept_length_counts`, e.g.
a `gpu-core --pair` run's) or the default geometric one (mean ~4 at gamma 7; `accept_replay.py`),
whatever the target says: a dummy drafter accepts nothing, and the tokens served are not a
model's. Each concurrency serves random 128-token prompts for 128 tokens (`ignore_eos`), after a
few warm-up requests; output tok/s, ITL and TTFT as `sparkwire bench serve` reports them.

    sparkwire bench dspark-serve --out $OUT/dspark_serve.json   # H100: about 5 minutes
    sparkwire bench dspark-serve --device cpu --model-config ops/models/sparkwire-micro \\
        --draft-model ops/models/sparkwire-micro-dspark --concurrency 1 2 --prompts-per-level 2 --output-len 8 --out /tmp/ds.json
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from ops.bench import scheduler_harness as harness
from ops.bench.accept_replay import AcceptReplay
from ops.bench.common import MODEL_CONFIGS, RESULTS, write_json
from ops.bench.gpu_serve_check import serving_model_dir
from ops.bench.serve import ServeConfig, run_serve_benchmark
from ops.bench.serve_launch import LoggedProcess, health_ok
from services.common.nats_server import free_port, start_nats_server

READY_TIMEOUT_S = 900.0
STOP_GRACE_S = 30.0
MODES = ("plain", "static", "compact")


def scheduler_argv(args: argparse.Namespace, model_dir: Path, nats_url: str, mode: str) -> list[str]:
    argv = [sys.executable, "-m", "ops.bench.dspark_serve", "--child"]
    if args.accept_lengths is not None:
        argv += ["--accept-lengths", str(args.accept_lengths)]
    argv += ["--", "--model", str(model_dir), "--nats-url", nats_url, "--device", args.device, "--load-format", "dummy",
             "--max-running-requests", str(max(args.concurrency)), *shlex.split(args.scheduler_flags)]  # fmt: skip
    if mode != "plain":
        argv += ["--speculative-algorithm", "dspark", "--draft-model", str(args.draft_model), "--verify-mode", mode]
    return argv


def level(args: argparse.Namespace, base_url: str, model_dir: Path, concurrency: int) -> dict[str, Any]:
    serve = ServeConfig(base_url=base_url, num_prompts=args.prompts_per_level * concurrency, input_len=args.input_len,
                        output_len=args.output_len, ignore_eos=True, max_concurrency=concurrency,
                        num_warmups=min(concurrency, 4), vocab_from=model_dir, progress=False)  # fmt: skip
    result = run_serve_benchmark(serve)
    keep = ("output_throughput", "completed", "failed", "itl_ms", "ttft_ms", "duration_s")
    return {"concurrency": concurrency, **{key: result.get(key) for key in keep}}


def run_mode(args, mode: str, model_dir: Path, nats_url: str, base_url: str, logs: Path, deadline: float) -> list[dict]:
    if time.monotonic() > deadline:
        return [{"mode": mode, "skipped": "over --budget-s"}]
    scheduler = LoggedProcess.start(f"scheduler-{mode}", scheduler_argv(args, model_dir, nats_url, mode), logs / f"scheduler-{mode}.log")
    try:
        scheduler.wait_until(lambda: "scheduler.ready" in scheduler.log(), READY_TIMEOUT_S, f"scheduler ({mode}) not ready")
        scheduler.wait_until(lambda: health_ok(base_url), READY_TIMEOUT_S, f"{base_url}/health not 200")
        return [{"mode": mode, **level(args, base_url, model_dir, c)} for c in args.concurrency if time.monotonic() < deadline]
    finally:
        scheduler.stop(STOP_GRACE_S)


def summary_rows(rows: list[dict]) -> list[dict]:
    # a level where requests failed has no throughput to compare (a scheduler that ran out of memory
    # answers a few requests fast and fails the rest)
    tok_s = {(r["mode"], r["concurrency"]): r["output_throughput"] for r in rows if r.get("output_throughput") and not r.get("failed")}
    out = []
    for concurrency in sorted({c for _, c in tok_s}):
        plain = tok_s.get(("plain", concurrency))
        row = {"concurrency": concurrency, "plain_tok_s": plain}
        for mode in MODES[1:]:
            value = tok_s.get((mode, concurrency))
            row[f"{mode}_tok_s"], row[f"{mode}_speedup"] = value, (value / plain if value and plain else None)
        row["failed"] = {r["mode"]: r["failed"] for r in rows if r.get("concurrency") == concurrency and r.get("failed")}
        out.append(row)
    return out


def table(result: dict) -> str:
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    lines = [f"acceptance replayed: {result['accept_replay']}", "| concurrency | plain tok/s | static tok/s (x) | compact tok/s (x) |",
             "|---|---|---|---|"]  # fmt: skip
    for r in result.get("summary", []):
        lines.append(f"| {r['concurrency']} | {fmt(r['plain_tok_s'], '.0f')} | {fmt(r['static_tok_s'], '.0f')} "
                     f"({fmt(r['static_speedup'], '.2f')}) | {fmt(r['compact_tok_s'], '.0f')} ({fmt(r['compact_speedup'], '.2f')}) |"
                     + "".join(f" {mode}: {n} failed" for mode, n in r.get("failed", {}).items()))  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    deadline = time.monotonic() + args.budget_s
    source = str(args.accept_lengths) if args.accept_lengths else "geometric, mean ~4 at gamma 7"
    result: dict[str, Any] = {"model_config": str(args.model_config), "draft_model": str(args.draft_model), "accept_replay": source}
    logs = args.out.parent / "dspark_serve_logs"
    logs.mkdir(parents=True, exist_ok=True)
    nats = start_nats_server()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    front: list[LoggedProcess] = []
    rows: list[dict] = []
    try:
        with tempfile.TemporaryDirectory(prefix="sparkwire-dspark-serve-") as tmp:
            model_dir = serving_model_dir(args.model_config, Path(tmp) / "model")
            for name, extra in (("detokenizer", []), ("tokenizer", ["--port", str(port)])):
                argv = [sys.executable, "-m", "services.cli", name, *extra, "--nats-url", nats.url, "--model", str(model_dir)]
                front.append(LoggedProcess.start(name, argv, logs / f"{name}.log"))
            for mode in args.modes:
                rows += run_mode(args, mode, model_dir, nats.url, base_url, logs, deadline)
    except Exception:
        result["error"] = traceback.format_exc()[-4000:]
    finally:
        for process in front:
            process.stop(STOP_GRACE_S)
        nats.stop()
    result["rows"], result["summary"] = rows, summary_rows(rows)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-config", type=Path, default=MODEL_CONFIGS / "Qwen3-8B", help="target shape (dummy weights)")
    parser.add_argument("--draft-model", type=Path, default=MODEL_CONFIGS / "Qwen3-8B-dspark", help="draft config (dummy weights)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", nargs="*", type=int, default=[1, 16, 64])
    parser.add_argument("--prompts-per-level", type=int, default=4, help="requests per concurrency level: this many times it")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--accept-lengths", type=Path, default=None, help="a JSON with accept_length_counts to replay")
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    parser.add_argument("--scheduler-flags", default="", help="more `sparkwire scheduler` flags for every mode (e.g. --kv-cache-memory-fraction 0.7)")
    parser.add_argument("--budget-s", type=float, default=480, help="modes and levels not started by then are skipped")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the replaying scheduler itself
    parser.add_argument("scheduler_args", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "dspark_serve.json")


def main(args: argparse.Namespace) -> int:
    if args.child:
        return harness.serve_replayed(args.scheduler_args, lambda gamma: replay_for(args.accept_lengths, gamma))
    result = run(args)
    write_json(args.out, result)
    print(table(result))
    return 1 if "error" in result else 0


def replay_for(path: Path | None, gamma: int) -> AcceptReplay:
    return AcceptReplay.load(path, gamma) if path is not None else AcceptReplay.geometric(gamma)


if __name__ == "__main__":
    from ops.bench.common import script

    raise SystemExit(script(__doc__, add_arguments, main))
