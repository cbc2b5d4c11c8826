"""What the GPU's clock and power did while a benchmark ran: NVML sampled from a thread.

A long prefill on the H200 runs its GEMMs ~10% under the rate the same GEMMs reach in short bursts
(gpu_prefill_profile.md, gpu_gated_mlp.md); whether the card holds its clock down for power is what
decides if faster kernels can still win time or only move it. `ClockSampler` answers that: the SM
clock, board power and the driver's throttle reasons every `interval_s`, summarised (median, min,
max; the share of samples with each active reason). Reads only: it never sets clocks or limits.
NVML comes from `nvidia-ml-py` (`pynvml`), present on the GPU image; without it (or without a GPU)
the summary says why and the benchmark runs on.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

# NVML's clocks-event (throttle) reason bits, by the names nvidia-smi prints
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal",
           0x40: "hw_thermal", 0x80: "hw_power_brake"}  # fmt: skip


class ClockSampler:
    """`with ClockSampler() as clocks: ...`, then `clocks.summary()`."""

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
        while (now := time.perf_counter() - start) < seconds:
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
