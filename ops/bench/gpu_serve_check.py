"""Online serving through the whole stack on one GPU: `sparkwire up --device cuda --load-format
dummy` on a model shape (default Qwen3-8B), then `sparkwire bench serve` scenarios against it, with
the scheduler core's batch figure for the same shape measured first, in the same run, as the bar
the stack is held to (issue 12: stack output tok/s >= 0.9x the core's at batch = concurrency).

Scenarios (128-token random prompts, 128 output tokens, `ignore_eos`, streamed to /generate):
- `concurrency`: at most `--concurrency` (64) requests in flight, `--num-prompts` of them;
- `concurrency_logprobs`: the same with top-20 output logprobs per token;
- `batch1` / `batch1_logprobs`: one request at a time (its TPOT is the stack's ms per decode step);
- `poisson`: Poisson arrivals at `--load` (0.8) x the request rate `concurrency` sustained;
- `long_prompt_top2`: `--long-prompt-len` (32768) random tokens, one output token, top-2 logprobs
  of every prompt position, one request at a time (issue 12, point 5, through the whole stack:
  its E2E is the prefill, the logprobs and their trip to the client).

The model directory the stack serves is the shape's `config.json` beside the bundled model's
tokenizer (the shapes in ops/model_configs carry no tokenizer): ids the tokenizer lacks decode to
empty text, which costs the detokenizer nothing a real tokenizer would not.

    sparkwire bench gpu-serve --out $OUT/gpu_serve.json
    sparkwire bench gpu-serve --model-config ops/model_configs/Qwen3-0.6B --no-core-baseline --num-prompts 2560 \
        --scenarios concurrency concurrency_logprobs batch1 batch1_logprobs --out $OUT/gpu_serve_06b.json
    sparkwire bench gpu-serve --device cpu --model-config ops/models/sparkwire-micro --no-core-baseline \
        --concurrency 3 --num-prompts 6 --input-len 8 --output-len 4 --long-prompt-len 40 --out /tmp/serve.json  # smoke

`sparkwire bench gpu-serve-ab` (serve_ab.py) runs this file of two trees on one machine, alternating.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.bench import scheduler_profile, step_trace_summary
from ops.bench.common import REPO, RESULTS, script
from ops.bench.logprob_transport import ProcessMeter
from ops.bench.reliability import descendants
from ops.bench.serve import ServeConfig, run_serve_benchmark
from ops.bench.step_trace_summary import in_window, read_trace
from ops.bench.serve_launch import launched_stack
from services.models import BUNDLED_MODEL
from services.common.nats_server import free_port

SCENARIOS = ("concurrency", "concurrency_logprobs", "batch1", "batch1_logprobs", "poisson", "long_prompt_top2")
TOP_LOGPROBS = 20
SHAPE_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CORE_TIMEOUT_S = 300.0  # leaves most of a 10-minute device call to the stack


@dataclass(frozen=True)
class CheckConfig:
    model_config: Path = REPO / "ops/model_configs/Qwen3-8B"
    device: str = "cuda"
    concurrency: int = 64
    num_prompts: int = 320  # five waves of `concurrency`: a steady state, not one batch
    batch1_prompts: int = 8
    long_prompt_len: int = 32768
    long_prompts: int = 3
    input_len: int = 128
    output_len: int = 128
    load: float = 0.8  # the Poisson rate as a fraction of what `concurrency` sustained
    request_rate: float | None = None  # the Poisson rate itself, instead of `load`
    # Warm-ups before each scenario (graphs captured, allocator warm), sent at the scenario's
    # concurrency; None: as many as the concurrency, so that every connection the timed run uses is
    # open: with fewer, the first wave's requests on new connections came late, and the closed loop
    # kept that stagger wave after wave (ops/bench/results/gpu_serve.md).
    num_warmups: int | None = None
    core_baseline: bool = True  # the scheduler core at batch = concurrency, first (GPU only)
    scenarios: tuple[str, ...] = SCENARIOS
    up_args: tuple[str, ...] = ()  # more `sparkwire up` flags
    progress: bool = True
    step_trace: bool = True  # the scheduler's step trace, summarized per scenario (`step_trace_summary.py`)
    profile_scheduler: bool = False  # py-spy on the scheduler during each scenario (`scheduler_profile.py`)


def serving_model_dir(model_config: Path, into: Path) -> Path:
    """The shape's config beside the bundled tokenizer: a directory `sparkwire up` can serve."""
    into.mkdir(parents=True, exist_ok=True)
    for name in SHAPE_FILES:
        if (model_config / name).is_file():
            shutil.copy(model_config / name, into / name)
    for name in TOKENIZER_FILES:
        if not (into / name).exists():
            shutil.copy(BUNDLED_MODEL / name, into / name)
    return into


def core_baseline(check: CheckConfig, work: Path) -> dict[str, Any]:
    """`gpu_peer_check.py` at batch = concurrency in a child process (the GPU is then all the
    stack's); its tok/s counts generated tokens over the core's wall time, as ours does."""
    out = work / "core.json"
    command = [sys.executable, "-m", "ops.bench.gpu_peer_check", "--device", check.device, "--configs", str(check.model_config),
               "--batch-sizes", str(check.concurrency), "--prompt-len", str(check.input_len),
               "--new-tokens", str(check.output_len), "--no-peer", "--out", str(out)]  # fmt: skip
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=CORE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"timed out after {exc.timeout:.0f}s"}
    written = json.loads(out.read_text()) if out.is_file() else {}
    rows = written.get("rows") or []
    if done.returncode != 0 or not rows:
        return {"error": (done.stdout + done.stderr)[-3000:]}
    return {"batch": check.concurrency, "tok_s": rows[0]["sparkwire"]["tok_s"],
            "tok_s_logprobs": rows[0]["sparkwire_logprobs"]["tok_s"], "device": written.get("device"),
            "torch": written.get("torch")}  # fmt: skip


def scenario_config(name: str, check: CheckConfig, base_url: str, measured: dict[str, dict]) -> ServeConfig:
    base = ServeConfig(
        base_url=base_url, num_prompts=check.num_prompts, input_len=check.input_len, output_len=check.output_len,
        ignore_eos=True, max_concurrency=check.concurrency, progress=check.progress,
        num_warmups=check.concurrency if check.num_warmups is None else check.num_warmups,
        seed=SCENARIOS.index(name) if name in SCENARIOS else 0,  # prompts of its own: the prefix cache holds the last scenario's
    )  # fmt: skip
    batch1 = dataclasses.replace(base, max_concurrency=1, num_prompts=check.batch1_prompts, num_warmups=2)
    if name == "poisson":
        return dataclasses.replace(base, max_concurrency=None, request_rate=poisson_rate(check, measured))
    if name == "long_prompt_top2":
        return dataclasses.replace(base, max_concurrency=1, num_prompts=check.long_prompts, num_warmups=1, input_len=check.long_prompt_len,
                                   output_len=1, logprobs=2, prompt_logprobs=True)  # fmt: skip
    configs = {"concurrency": base, "concurrency_logprobs": dataclasses.replace(base, logprobs=TOP_LOGPROBS),
               "batch1": batch1, "batch1_logprobs": dataclasses.replace(batch1, logprobs=TOP_LOGPROBS)}  # fmt: skip
    return configs[name]


def poisson_rate(check: CheckConfig, measured: dict[str, dict]) -> float:
    if check.request_rate is not None:
        return check.request_rate
    if "concurrency" not in measured:
        raise ValueError("the poisson scenario needs --request-rate or the concurrency scenario before it")
    return check.load * measured["concurrency"]["request_throughput"]


def run(check: CheckConfig, out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"check": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(check).items()}}
    with tempfile.TemporaryDirectory(prefix="sparkwire-gpu-serve-") as tmp:
        work = Path(tmp)
        if check.core_baseline:
            result["core_baseline"] = core_baseline(check, work)
        try:
            result.update(serve_scenarios(check, serving_model_dir(check.model_config, work / "model"), out.with_name(out.stem + "_up.log")))
        except Exception as exc:  # the stack did not come up: keep what was measured, and why
            headline = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            result.update(stack_error=headline, stack_error_detail=traceback.format_exc()[-4000:], scenarios={})
    result["stack_vs_core"] = stack_vs_core(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result


def serve_scenarios(check: CheckConfig, model_dir: Path, log_path: Path) -> dict[str, Any]:
    trace_dir = log_path.with_name(log_path.stem.removesuffix("_up") + "_trace")
    up_args = ("--device", check.device, "--load-format", "dummy", "--model", str(model_dir), *check.up_args)
    up_args += ("--step-trace", str(trace_dir)) if check.step_trace else ()
    base_url = f"http://127.0.0.1:{free_port()}"
    if check.profile_scheduler:
        scheduler_profile.py_spy()  # missing: fail before the stack starts
    spy_path = log_path.with_name(log_path.stem.removesuffix("_up") + "_spy.txt") if check.profile_scheduler else None
    earlier = set(trace_dir.glob("*.jsonl"))  # an earlier run's with the same --out: not this stack's
    with launched_stack(up_args, base_url, log_path) as stack:
        scenarios = run_scenarios(check, base_url, stack.up.process.pid, spy_path)
    if check.step_trace:
        add_step_traces(scenarios, sorted(set(trace_dir.glob("*.jsonl")) - earlier))
    return {"ready_s": stack.ready_s, "up_exit_code": stack.exit_code, "scenarios": scenarios,
            "ragged_captures": captures_in_log(log_path, RAGGED_CAPTURE), "logprob_captures": captures_in_log(log_path, LOGPROB_CAPTURE),
            "flash4_warmed_s": flash4_warmed_s(log_path)}  # fmt: skip


def flash4_warmed_s(log_path: Path) -> float | None:
    """The seconds the scheduler spent compiling FlashAttention-4 at start-up (`--dense-attention`
    took it), from its log; None: it attended long prompts with SDPA."""
    text = log_path.read_text() if log_path.is_file() else ""
    found = re.search(r"dense_attention\.warmed.*?kernel=flash4.*?seconds=([0-9.]+)", text)
    return float(found.group(1)) if found else None


def add_step_traces(scenarios: dict[str, dict], traces: list[Path]) -> None:
    """Each scenario's timed window of the (one) scheduler's step trace, summarized, as `step_trace`."""
    if len(traces) != 1:
        return
    lines = read_trace(traces[0])
    for result in scenarios.values():
        if "monotonic_window" in result:
            result["step_trace"] = step_trace_summary.summarize(in_window(lines, *result["monotonic_window"]))
            concurrency = result.get("config", {}).get("max_concurrency")
            if concurrency and result.get("requests"):
                result["turnaround"] = closed_loop_turnaround(result["requests"], lines, concurrency)


def closed_loop_turnaround(requests: list[dict], trace_lines: list[dict], concurrency: int) -> dict[str, float] | None:
    """Where a slot of a closed loop (`concurrency` requests in flight, the next one sent as one
    ends) spends the time it runs nothing at the scheduler (the decode batch's shortfall), mean ms a
    turnover, over the steady part of the run (from the send that fills the last slot to the last
    send; the ramp and the drain left out):
    - `slot_idle`: (concurrency - the scheduler's running requests, time-weighted) x that window /
      the sends in it;
    - `queued`: from arrival at the scheduler until first scheduled (the trace's `queued_s`);
    - `client`: from a stream's end at the client until the next request is sent. The k-th stream
      to end frees the slot the (concurrency + k)-th request is sent in;
    - `in_stack`: the rest: a finish's way out (publication, detokenizer, front end, HTTP) and the
      next request's way in (front end, NATS) up to its arrival at the scheduler;
    - `stream_tail`: part of `in_stack`: from the last token's event to the stream's end.
    None without the figures (a trace from before `queued_s`, requests without `sent_at`)."""
    done = [r for r in requests if r["ok"] and r.get("sent_at")]
    if len(done) <= concurrency:
        return None
    sends = sorted(r["sent_at"] for r in done)
    ends = sorted(r["sent_at"] + r["e2e_s"] for r in done)
    steady = step_trace_summary.summarize(in_window(trace_lines, sends[concurrency - 1], sends[-1]))
    if not steady.get("queue_ms") or steady.get("running_time_weighted") is None:
        return None
    turnovers = len(done) - concurrency
    client_ms = sum(sends[concurrency + k] - ends[k] for k in range(turnovers)) * 1e3 / turnovers
    slot_idle_ms = 1e3 * (concurrency - steady["running_time_weighted"]) * steady["span_s"] / turnovers
    return {"slot_idle_ms": slot_idle_ms, "queued_ms": steady["queue_ms"]["mean"], "client_ms": client_ms,
            "in_stack_ms": slot_idle_ms - steady["queue_ms"]["mean"] - client_ms,
            "stream_tail_ms": 1e3 * sum(r["e2e_s"] - r["last_token_s"] for r in done) / len(done)}  # fmt: skip


# The scheduler's log lines for a CUDA graph captured while serving, and the group holding its time in seconds / ms.
RAGGED_CAPTURE = (r"ragged_capture\.done.*?seconds=([0-9.]+)", 1.0)
LOGPROB_CAPTURE = (r"logprob_graph_captured.*?capture_ms=([0-9.]+)", 1e-3)


def captures_in_log(log_path: Path, capture: tuple[str, float]) -> dict[str, float]:
    """CUDA graphs (ragged steps, or output logprobs) the scheduler captured while serving (warm-ups
    included), from its log: each capture is a pause of every request in flight."""
    pattern, to_seconds = capture
    text = log_path.read_text() if log_path.is_file() else ""
    seconds = [float(m.group(1)) * to_seconds for m in re.finditer(pattern, text)]
    return {"count": len(seconds), "seconds": round(sum(seconds), 3), "longest_s": round(max(seconds, default=0.0), 3)}


def run_scenarios(check: CheckConfig, base_url: str, up_pid: int | None = None, spy_path: Path | None = None) -> dict[str, dict]:
    """Each scenario in order; one that fails is recorded and the rest still run. With `up_pid`,
    each records the CPU its stack's processes used meanwhile (`stack_cpu`); with `spy_path` too,
    py-spy's profile of the scheduler's GIL meanwhile (`scheduler_profile`, warm-ups included; the
    raw samples beside `spy_path`, one file a scenario)."""
    measured: dict[str, dict] = {}
    for name in check.scenarios:
        scheduler = _scheduler_pid(up_pid) if spy_path is not None else None
        recording = None if scheduler is None else scheduler_profile.Recording.start(scheduler, spy_path.with_stem(f"{spy_path.stem}_{name}"))
        before, began = tree_cpu_seconds(up_pid), time.monotonic()
        try:
            measured[name] = run_serve_benchmark(scenario_config(name, check, base_url, measured))
        except Exception:
            measured[name] = {"error": traceback.format_exc()[-3000:]}
            continue
        finally:
            profile = None if recording is None else recording.stop(time.monotonic() - began)
        wall, after = time.monotonic() - began, tree_cpu_seconds(up_pid)
        measured[name]["stack_cpu"] = {proc: round((after[proc] - before.get(proc, 0.0)) / wall, 3) for proc in after}
        if profile is not None:
            measured[name]["scheduler_profile"] = profile
    return measured


def _scheduler_pid(up_pid: int | None) -> int | None:
    """The (first) scheduler process under `sparkwire up`."""
    if up_pid is None or not Path("/proc").is_dir():
        return None
    for pid in sorted(descendants(up_pid)):
        try:
            if _process_name(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")) == "sparkwire scheduler":
                return pid
        except OSError:
            continue
    return None


def tree_cpu_seconds(root: int | None) -> dict[str, float]:
    """CPU seconds (user + system) of `root` and every process below it, by what each runs
    (`sparkwire tokenizer`, `nats-server`, ...), from /proc (`reliability.descendants`,
    `logprob_transport.ProcessMeter`); {} where there is none, or a process left meanwhile."""
    if root is None or not Path("/proc").is_dir():
        return {}
    pids = {root} | descendants(root)
    try:
        names = {pid: _process_name(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")) for pid in pids}
        readings = ProcessMeter({str(pid): pid for pid in pids}).read()
    except OSError:
        return {}
    totals: dict[str, float] = {}
    for pid in pids:
        totals[names[pid]] = totals.get(names[pid], 0.0) + readings[str(pid)][0]
    return totals


def _process_name(argv: list[bytes]) -> str:
    words = [Path(a.decode(errors="replace")).name for a in argv if a]
    for service in ("tokenizer", "scheduler", "detokenizer", "up"):
        if service in words:
            return f"sparkwire {service}"
    return words[0] if words else "?"


def stack_vs_core(result: dict[str, Any]) -> float | None:
    core = result.get("core_baseline", {}).get("tok_s")
    stack = result["scenarios"].get("concurrency", {}).get("output_throughput")
    return stack / core if core and stack else None


def table(result: dict[str, Any]) -> str:
    lines = ["| scenario | ok / failed | req/s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms | E2E p50 ms "
             "| client CPU |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in result["scenarios"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'].splitlines()[-1][:80]} | | | | | | | |")
            continue
        ttft, itl = r["ttft_ms"], r["itl_ms"]
        lines.append(f"| {name} | {r['completed']} / {r['failed']} | {r['request_throughput']:.2f} | {r['output_throughput']:.0f} | "
                     f"{_ms(ttft['p50'])} / {_ms(ttft['p99'])} | {_ms(itl['p50'])} / {_ms(itl['p99'])} | "
                     f"{_ms(r['tpot_ms']['p50'])} | {_ms(r['e2el_ms']['p50'])} | {r['client_cpu_fraction']:.2f} |")  # fmt: skip
    if "stack_error" in result:
        lines.append(f"\nthe stack did not serve: {result['stack_error'][:200]}")
    for name, r in result["scenarios"].items():
        if r.get("stack_cpu"):
            lines.append(f"\nCPU of the stack's processes during `{name}` (cores, warm-ups included): "
                         + ", ".join(f"{proc} {cores:.2f}" for proc, cores in sorted(r["stack_cpu"].items())))  # fmt: skip
        if "step_trace" in r:
            lines.append(f"\nsteps of `{name}`: {step_trace_summary.table(r['step_trace'])}")
        if r.get("turnaround"):
            lines.append(f"\nturnaround of `{name}`, ms a turnover: " + ", ".join(f"{key.removesuffix('_ms')} {ms:.2f}"
                                                                              for key, ms in r["turnaround"].items()))  # fmt: skip
        if "scheduler_profile" in r:
            lines.append(f"\n`{name}`: {scheduler_profile.table(r['scheduler_profile'])}")
    for kind in ("ragged", "logprob"):
        captures = result.get(f"{kind}_captures")
        if captures:
            lines.append(f"\n{kind} graphs captured while serving (warm-ups included): {captures['count']}, "
                         f"{captures['seconds']} s in all, longest {captures['longest_s']} s")  # fmt: skip
    core = result.get("core_baseline")
    if core:
        lines.append(f"\ncore at batch {core.get('batch')}: {core.get('tok_s', 'error')} tok/s; "
                     f"stack / core = {result['stack_vs_core']}")  # fmt: skip
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-config", type=Path, default=CheckConfig.model_config)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=320)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--num-warmups", type=int, default=None, help="warm-up requests per scenario (default: the concurrency)")
    parser.add_argument("--long-prompt-len", type=int, default=32768, help="the long_prompt_top2 scenario's prompt length")
    parser.add_argument("--request-rate", type=float, default=None)
    parser.add_argument("--batch1-prompts", type=int, default=CheckConfig.batch1_prompts, help="requests of the batch1 scenarios")
    parser.add_argument("--no-core-baseline", action="store_true")
    parser.add_argument("--scenarios", nargs="*", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--up-args", default="", help='more `sparkwire up` flags, e.g. --up-args="--chunked-prefill-size 8192"')
    parser.add_argument("--no-step-trace", action="store_true", help="run the scheduler without its step trace")
    parser.add_argument("--profile-scheduler", action="store_true",
                        help="py-spy the scheduler's GIL during each scenario (needs py-spy: the 'profile' extra; scheduler_profile.py)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_serve.json")


def main(args: argparse.Namespace) -> int:
    check = CheckConfig(
        model_config=args.model_config, device=args.device, concurrency=args.concurrency, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, load=args.load, request_rate=args.request_rate,
        num_warmups=args.num_warmups, long_prompt_len=args.long_prompt_len, batch1_prompts=args.batch1_prompts,
        core_baseline=not args.no_core_baseline, scenarios=tuple(args.scenarios), up_args=tuple(shlex.split(args.up_args)),
        progress=sys.stderr.isatty(),  # a captured log gets the table, not thousands of bar updates
        step_trace=not args.no_step_trace, profile_scheduler=args.profile_scheduler,
    )  # fmt: skip
    result = run(check, args.out)
    failed = [name for name, figures in result["scenarios"].items() if "error" in figures or figures.get("failed")]
    return 1 if "stack_error" in result or failed else 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
