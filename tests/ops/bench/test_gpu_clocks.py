"""`common.ClockSampler`: NVML read from a thread and summarised; without NVML it says why."""

from __future__ import annotations

import sys
import time
import types

from ops.bench.common import ClockSampler


def fake_nvml(clocks: list[int], watts: list[float], reasons: list[int]) -> types.ModuleType:
    """A pynvml stand-in that returns the given readings in turn (the last one once they run out)."""
    module = types.ModuleType("pynvml")
    module.NVML_CLOCK_SM = 1
    calls = {"clock": 0, "power": 0, "reasons": 0}

    def reading(name: str, values: list):
        def read(*_args):
            value = values[min(calls[name], len(values) - 1)]
            calls[name] += 1
            return value
        return read

    module.nvmlInit = lambda: None
    module.nvmlDeviceGetHandleByIndex = lambda index: ("gpu", index)
    module.nvmlDeviceGetEnforcedPowerLimit = lambda handle: 700_000
    module.nvmlDeviceGetMaxClockInfo = lambda handle, kind: 1980
    module.nvmlDeviceGetClockInfo = reading("clock", clocks)
    module.nvmlDeviceGetPowerUsage = reading("power", [w * 1e3 for w in watts])
    module.nvmlDeviceGetCurrentClocksThrottleReasons = reading("reasons", reasons)  # the older name only: the fallback
    return module


def test_samples_are_summarised_with_the_share_of_each_throttle_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([1980, 1755, 1740, 1740], [420.0, 699.0, 700.0, 701.0], [0, 0x4, 0x4, 0x4]))
    with ClockSampler(interval_s=0.001) as clocks:
        while len(clocks.samples) < 8:
            time.sleep(0.001)
    summary = clocks.summary()
    assert summary["sm_mhz"]["max"] == 1980 and summary["sm_mhz"]["min"] == 1740 and summary["max_sm_mhz"] == 1980
    assert summary["power_w"]["max"] == 701.0 and summary["power_limit_w"] == 700.0
    share = summary["reasons_share"]["sw_power_cap"]
    assert summary["samples"] >= 8 and (summary["samples"] - 2) / summary["samples"] <= share < 1
    assert set(summary["reasons_share"]) == {"sw_power_cap"}


def test_without_nvml_the_summary_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with ClockSampler() as clocks:
        pass
    assert "unavailable" in clocks.summary() and clocks.samples == []
