"""Where a serving scheduler's GIL time goes: py-spy (https://github.com/benfred/py-spy, a sampling
profiler that reads a running process from outside, `pip install py-spy`) on the scheduler process
while a `gpu_serve_check.py` scenario runs (`--profile-scheduler`), summarized.

Why the GIL: the scheduler's step thread (`SchedulerCore.step`) and its event loop (publishing each
step's `TokenBatch`es, taking requests) share one interpreter, and on a host whose scheduler uses one
core (`stack_cpu`) a step waits for Python, not for the device: what holds the GIL is what a step
costs. py-spy runs with `--gil` (a sample only where a thread holds it), `--threads` (each stack
under its thread's name) and `--nonblocking` (the process is not paused to be read); its raw
output is one line per distinct stack: `thread (TID): name;frame;frame... COUNT`.

`summarize` turns that into: samples and the share of the wall time the GIL was held (samples over
rate x seconds), each thread's share, and the functions with the most samples of their own
(`own`) and under them (`inclusive`), as shares of all samples. Line numbers are dropped, so a
function is one entry.

    python -m ops.bench.scheduler_profile RAW.txt [--rate 250 --seconds 30]  # a saved profile's table
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

RATE_HZ = 250
TOP = 30
_LINE_NUMBER = re.compile(r":\d+\)$")
_THREAD_ID = re.compile(r"\s*\(\d+\)")


def py_spy() -> str:
    """The py-spy executable: this interpreter's (a virtual environment's scripts, which need not be
    on PATH), else PATH's; a clear error where there is none."""
    found = shutil.which("py-spy", path=sysconfig.get_path("scripts")) or shutil.which("py-spy")
    if found is None:
        raise RuntimeError("--profile-scheduler needs py-spy (pip install py-spy, or the test extras)")
    return found


@dataclass
class Recording:
    """py-spy recording one process until `stop`."""

    process: subprocess.Popen
    raw: Path
    rate_hz: int

    @classmethod
    def start(cls, pid: int, raw: Path, rate_hz: int = RATE_HZ) -> Recording:
        raw.parent.mkdir(parents=True, exist_ok=True)
        command = [py_spy(), "record", "--pid", str(pid), "--gil", "--threads", "--nonblocking", "--rate", str(rate_hz),
                   "--format", "raw", "--output", str(raw)]  # fmt: skip
        with raw.with_suffix(".log").open("w") as log:  # py-spy's own messages (the child keeps its copy)
            return cls(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), raw, rate_hz)

    def stop(self, seconds: float, timeout_s: float = 30.0) -> dict:
        """SIGINT (py-spy then writes what it sampled), wait, and the summary over `seconds` of wall."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if not self.raw.is_file():
            log = self.raw.with_suffix(".log")
            tail = log.read_text().strip().splitlines()[-3:] if log.is_file() else []
            return {"error": f"py-spy wrote no profile (exit {self.process.returncode}): {' / '.join(tail)}"}
        return summarize(self.raw.read_text(), self.rate_hz, seconds)


def summarize(raw: str, rate_hz: int, seconds: float | None = None, top: int = TOP) -> dict:
    """py-spy's raw lines -> samples, the GIL's held share of `seconds` (when given), per-thread and
    per-function shares of the samples."""
    total = 0
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        thread, *frames = stack.split(";")
        total += samples
        threads[_THREAD_ID.sub("", thread.removeprefix("thread")).strip(" :")] += samples
        functions = [_LINE_NUMBER.sub(")", frame) for frame in frames]
        if functions:
            own[functions[-1]] += samples
        for function in set(functions):
            inclusive[function] += samples

    def shares(counter: Counter[str], n: int | None = None) -> dict[str, float]:
        return {name: round(count / total, 4) for name, count in counter.most_common(n)} if total else {}

    held = round(total / (rate_hz * seconds), 3) if seconds else None
    return {"samples": total, "rate_hz": rate_hz, "seconds": seconds, "gil_held_share": held, "threads": shares(threads),
            "own": shares(own, top), "inclusive": shares(inclusive, top)}  # fmt: skip


def table(summary: dict, top: int = 15) -> str:
    if "error" in summary:
        return f"scheduler profile: {summary['error']}"
    held = summary["gil_held_share"]
    lines = [f"scheduler's GIL: {summary['samples']} samples at {summary['rate_hz']} Hz"
             + (f", held {held:.0%} of {summary['seconds']:.1f} s" if held is not None else "")
             + "; threads " + ", ".join(f"{name} {share:.0%}" for name, share in summary["threads"].items()),
             "| own | function | inclusive | function |", "|---|---|---|---|"]  # fmt: skip
    own, inclusive = list(summary["own"].items())[:top], list(summary["inclusive"].items())[:top]
    for i in range(max(len(own), len(inclusive))):
        a = own[i] if i < len(own) else ("", "")
        b = inclusive[i] if i < len(inclusive) else ("", "")
        lines.append(f"| {_pct(a[1])} | {a[0]} | {_pct(b[1])} | {b[0]} |")
    return "\n".join(lines)


def _pct(share: float | str) -> str:
    return f"{share:.1%}" if isinstance(share, float) else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path, help="py-spy's --format raw output")
    parser.add_argument("--rate", type=int, default=RATE_HZ)
    parser.add_argument("--seconds", type=float, default=None, help="the wall time it covered (for the GIL's held share)")
    args = parser.parse_args()
    print(table(summarize(args.raw.read_text(), args.rate, args.seconds)))


if __name__ == "__main__":
    main()
