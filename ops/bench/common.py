"""What the benchmarks share: JSON out, timers, device and clock readings, the GPU checks' flags
and sections, and dummy-weight shapes with the ragged batches run on them.

torch and NVML are imported inside the functions that need them, so the benchmarks of the front
half (no torch installed) can use the rest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "ops/bench/results"
MODEL_CONFIGS = REPO / "ops/model_configs"
TINY_MODEL = REPO / "ops/models/sparkwire-tiny"  # random weights, a few layers: the CPU smoke runs' model


# ---- output ----


def write_json(path: Path, document: object) -> None:
    """`document` as indented JSON at `path`, its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def rounded(row: dict) -> dict:
    return {k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in row.items()}


def section_rows(result: dict, name: str) -> list[dict]:
    """A section's rows; [] when it failed or was skipped (then it holds a dict saying why)."""
    value = result.get(name)
    return value if isinstance(value, list) else []


def failures(result: dict) -> list[str]:
    """Sections that failed, or a setting inside one (graph rows and profiles keep the other setting's)."""
    failed = []
    for name, value in result.items():
        rows = value if isinstance(value, list) else [value] if isinstance(value, dict) else []
        if any("error" in row or any(key.endswith("_error") for key in row) for row in rows):
            failed.append(name)
    return failed


# ---- devices and timers ----


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def bench_dtype(device: str):
    """bf16 on CUDA (as served), fp32 on the CPU (smoke runs compare exactly)."""
    import torch

    return torch.bfloat16 if device == "cuda" else torch.float32


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], device: str, repeats: int, warmup: int | None = None) -> float:
    """Median over `repeats` calls, each from an idle device: CUDA events (host launch gaps count), else the host clock.
    warmup: untimed calls first; by default 2 on CUDA (compiles, the allocator's growth) and none on the
    CPU, where a smoke run's times only show that it ran and a call may run Triton's interpreter (up to
    seconds a step)."""
    import torch

    for _ in range(warmup if warmup is not None else 2 if device == "cuda" else 0):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - begin))
    return round(statistics.median(times), 4)


def synced_seconds(call: Callable[[], object], digits: int = 4) -> float:
    """Host seconds of one call, the device idle before and drained after (a first call: its compile included)."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return round(time.perf_counter() - start, digits)


def graph_us(call: Callable[[], object], device, calls: int, repeats: int) -> float:
    """µs per call: a CUDA graph of `calls` calls replayed `repeats` times (`median_ms`), the way decode
    steps run; one call on the host clock off CUDA."""
    import torch

    if device.type != "cuda":
        begin = time.perf_counter()
        call()
        return round(1e6 * (time.perf_counter() - begin), 1)
    from services.scheduler.model.graphs import capture_graph

    def many() -> None:
        for _ in range(calls):
            call()

    graph, _ = capture_graph(many)
    us = 1e3 * median_ms(graph.replay, "cuda", repeats) / calls
    del graph
    torch.cuda.empty_cache()  # a 32k-token graph's pool holds `calls` outputs
    return round(us, 2)


def sync_count(fn: Callable[[], object], device: str) -> int | None:
    """Host syncs during fn, as torch's sync debug mode reports them (CUDA only)."""
    import warnings

    import torch

    if device != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def self_us(event, cuda: bool) -> float:
    """A profiler event's own time in µs: on the device for a kernel (0 for host ops), else on the CPU."""
    if not cuda:
        return event.self_cpu_time_total if event.key.startswith("aten::") else 0.0
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def copy_bandwidth_gb_s(device: str) -> float:
    """Device-to-device copy rate, bytes read plus written, median of 10 (0 off CUDA: not measured).
    The HBM roofline of a decode step is its weight bytes over this."""
    import torch

    if device != "cuda":
        return 0.0
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB, well past L2
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), "cuda", 10, warmup=3)
    return 2 * src.numel() * src.element_size() / copy_ms / 1e6


def decode_weight_bytes(runner) -> int:
    """Weight bytes one decode step reads: every parameter, the input embedding only where it is the LM head."""
    total = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    if not runner.config.tie_word_embeddings:
        embed = runner.model.model.embed_tokens.weight
        total -= embed.numel() * embed.element_size()
    return total


# ---- GPU checks: flags, sections, the end of a run ----


def add_check_arguments(parser: argparse.ArgumentParser, *, tiny: str, repeats: int, budget_s: float, out: str,
                        model: bool = False, what: str = "calls per measurement") -> None:  # fmt: skip
    """The flags every GPU check takes (--device, --tiny, [--model], --repeats, --budget-s, --out),
    with that check's help and defaults; the check adds its own after."""
    parser.add_argument("--device", default="cuda", help="cuda; cpu for the smoke run (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help=f"{tiny} (smoke)")
    if model:
        parser.add_argument("--model", type=Path, default=None, help="another config directory (dummy weights), e.g. ops/model_configs/Qwen3-0.6B")
    parser.add_argument("--repeats", type=int, default=repeats, help=f"timed {what} (median)")
    parser.add_argument("--budget-s", type=float, default=budget_s, help="sections not started this long after the start are skipped")
    parser.add_argument("--out", type=Path, default=Path(out), help="the JSON written")


def deadline_sections(result: dict, deadline: float) -> Callable[[str, Callable[[], object]], object]:
    """section(name, fn): result[name] = fn(), or the error, or "skipped" once the deadline has passed."""

    def section(name: str, fn: Callable[[], object]) -> object:
        if time.monotonic() > deadline:
            result[name] = {"skipped": "over --budget-s"}
            return None
        try:
            value = fn()
        except Exception:
            result[name] = {"error": traceback.format_exc()[-3000:]}
            return None
        result[name] = value
        return value

    return section


def only(names: list[str] | None, section: Callable[[str, Callable[[], object]], object]):
    """`section` restricted to `names` (None: all); the runner loads whenever a section needs it."""
    if not names:
        return section
    wanted = {*names, "runner"}
    return lambda name, fn: section(name, fn) if name in wanted else None


def finish_run(result: dict, args: argparse.Namespace, deadline: float, table: Callable[[dict], str]) -> dict:
    """A GPU check's last lines: its elapsed seconds (from --budget-s and the deadline), the JSON to
    --out, the table printed."""
    result["elapsed_s"] = round(args.budget_s - (deadline - time.monotonic()), 1)
    write_json(args.out, result)
    print(table(result))
    return result


def script(doc: str, add_arguments: Callable[[argparse.ArgumentParser], None], main: Callable[[argparse.Namespace], int | None],
           argv: list[str] | None = None) -> int:  # fmt: skip
    """A suite run as `python ops/bench/<file>.py ...` (what the interpreted smoke tests and other
    trees' runs do): the same flags and entry point as `sparkwire bench <name>`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_arguments(parser)
    return int(main(parser.parse_args(argv)) or 0)


# ---- dummy-weight shapes and ragged steps ----


@dataclass(frozen=True)
class Shape:
    """An attention/model shape the GPU checks run on (dummy weights) and the mixes they feed it."""

    model: Path
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    page: int  # the cache's block size
    decodes: int  # sequences decoding beside the prefill of a mixed step
    decode_context: int
    prefill: int  # the mixed step's prefill chunk
    prefills: tuple[tuple[int, int], ...]  # (context, new tokens) of the `prefills` mix
    long_prompt: int
    chunk: int  # the policy's chunk budget


def check_shape(tiny: bool) -> Shape:
    """The Qwen3-8B shape at the served cache block and chunk budget; tiny: the random test model's."""
    from ops.bench.scheduler_harness import CHUNKED_PREFILL_SIZE, KV_BLOCK_SIZE

    if tiny:
        return Shape(TINY_MODEL, 4, 2, 32, 4, 16, 4, 24, 20, ((0, 20), (40, 9), (7, 3)), 256, 64)
    return Shape(
        MODEL_CONFIGS / "Qwen3-8B", 32, 8, 128, 36, KV_BLOCK_SIZE, 64, 256, 128,
        ((0, 512), (1024, 384), (4096, 320), (37, 256), (8192, 224), (500, 192), (16000, 96), (3000, 64)),
        32768, CHUNKED_PREFILL_SIZE,
    )  # fmt: skip


def load_runner(shape: Shape, device: str, dtype):
    """The shape's runner, dummy weights, no graphs captured (a check captures what it times)."""
    from services.scheduler.model.loader import load_model_runner

    return load_model_runner(shape.model, device=device, dtype=dtype, load_format="dummy", kv_block_size=shape.page,
                             cuda_graphs=False)  # fmt: skip


def ragged_step(chunks: list[tuple[int, int]], page: int, width: int, device: str, seqs: list[int] | None = None):
    """One `ForwardBatch` of (context, new tokens) per sequence; sequence s owns pages s * width .. (s + 1) * width - 1."""
    import numpy as np
    import torch

    from services.scheduler.model.batch import ForwardBatch

    seqs = list(range(len(chunks))) if seqs is None else seqs
    positions = [torch.arange(ctx, ctx + n) for ctx, n in chunks]
    slots = [(s * width + pos // page) * page + pos % page for s, pos in zip(seqs, positions)]
    query_lens = tuple(n for _, n in chunks)
    seq_lens = tuple(ctx + n for ctx, n in chunks)
    tables = torch.tensor(seqs)[:, None] * width + torch.arange(width)[None, :]  # [B, width]
    ids = torch.randint(0, 2048, (sum(query_lens),), generator=torch.Generator().manual_seed(len(chunks)))
    return ForwardBatch(
        input_ids=ids.to(device),
        positions=torch.cat(positions).to(device),
        query_start_loc=torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(torch.int32).to(device),
        slot_mapping=torch.cat(slots).to(device),
        host_query_lens=query_lens,
        host_seq_lens=seq_lens,
    )


def next_tokens(runner, hidden):
    return runner.compute_logits(hidden).argmax(-1)


def worst_row_rel_diff(got, want) -> float:
    """max over rows of |got - want|_inf / |want|_inf: one wrong row stands out of the bf16 noise."""
    return float(((got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-6)).max())


# ---- GPU clocks (NVML) ----

# NVML's clocks-event (throttle) reason bits, by the names nvidia-smi prints
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal",
           0x40: "hw_thermal", 0x80: "hw_power_brake"}  # fmt: skip


class ClockSampler:
    """What the GPU's clock and power did while a benchmark ran, sampled from a thread: whether the
    card held its clock down for power decides if faster kernels can still win time or only move it.
    `with ClockSampler() as clocks: ...`, then `clocks.summary()`. Reads only: never sets clocks or
    limits. Without NVML (`nvidia-ml-py`) or a GPU the summary says why and the benchmark runs on."""

    def __init__(self, device_index: int = 0, interval_s: float = 0.01) -> None:
        self.device_index = device_index
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, int]] = []  # (SM MHz, watts, reason bits)
        self.unavailable: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
            self.limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
            self.max_sm_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
        except Exception as exc:  # no pynvml, no driver, no GPU: say so, sample nothing
            self.unavailable = f"{type(exc).__name__}: {exc}"
            return self
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self._thread = threading.Thread(target=self._sample, args=(pynvml, handle, reasons), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self, pynvml, handle, reasons_of) -> None:
        while not self._stop.is_set():
            sm = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
            watts = pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3
            self.samples.append((float(sm), watts, int(reasons_of(handle))))
            time.sleep(self.interval_s)

    def summary(self) -> dict[str, Any]:
        if self.unavailable is not None or not self.samples:
            return {"unavailable": self.unavailable or "no samples"}
        sm, watts, reasons = zip(*self.samples)
        share = {name: round(sum(bool(r & bit) for r in reasons) / len(reasons), 3) for bit, name in REASONS.items()}
        return {"samples": len(sm), "sm_mhz": _spread(sm), "max_sm_mhz": self.max_sm_mhz, "power_w": _spread(watts),
                "power_limit_w": self.limit_w, "reasons_share": {k: v for k, v in share.items() if v}}  # fmt: skip


def _spread(values: tuple[float, ...]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1), "max": round(max(values), 1)}


def sustained_gemm(seconds: float = 3.0, size: int = 8192) -> dict[str, Any]:
    """bf16 [size x size] @ [size x size] back to back for `seconds`, on random data: TFLOP/s over
    the first 0.2 s and the last second, with the clocks over the whole run. A card that holds its
    clock down for power shows it here: the same kernel slower at the end than at the start."""
    import torch

    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flop = 2 * size**3
    torch.cuda.synchronize()
    marks: list[tuple[float, int]] = []  # (seconds since start, products done)
    with ClockSampler() as clocks:
        start, done = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            for _ in range(8):
                torch.mm(a, b)
            torch.cuda.synchronize()
            done += 8
            marks.append((time.perf_counter() - start, done))
    return {"first_0.2s_tflops": round(_rate(marks, 0.0, 0.2) * flop / 1e12, 1),
            "last_1s_tflops": round(_rate(marks, seconds - 1.0, seconds) * flop / 1e12, 1), "clocks": clocks.summary()}  # fmt: skip


def _rate(marks: list[tuple[float, int]], begin: float, end: float) -> float:
    """Products per second between the first marks at or past `begin` and `end` (the last mark if none)."""
    first = next(m for m in marks if m[0] >= begin)
    last = next((m for m in marks if m[0] >= end), marks[-1])
    return (last[1] - first[1]) / max(last[0] - first[0], 1e-9)
