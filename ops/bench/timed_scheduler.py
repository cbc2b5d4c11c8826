"""A scheduler process whose every `SchedulerCore.step` is timed, for `step_gap.py`.

    python ops/bench/timed_scheduler.py --step-times OUT.json <sparkwire scheduler flags>

Run as a script with `PYTHONPATH=<checkout>`, it serves from that checkout's `services` (an older
commit's, to compare decode loops); the timing wraps the class's `step` from outside, so the
service's hot path is the checkout's own. On exit it writes, per step, its start and end
(`time.perf_counter`, seconds) and whether the core still had work when it ended (only then is the
time until the next step's start overhead, not idleness), the process's CPU seconds, and which
`services` it ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import services
from services.scheduler import __main__ as scheduler_main
from services.scheduler.core import SchedulerCore


def timed_steps(record: list[tuple[float, float, bool]]) -> None:
    """Every `SchedulerCore.step` from now on appends (start, end, work left) to `record`."""
    step = SchedulerCore.step

    def timed(core: SchedulerCore, on_queued=None):
        start = time.perf_counter()
        outputs = step(core, on_queued)
        end = time.perf_counter()
        record.append((start, end, core.has_work()))
        return outputs

    SchedulerCore.step = timed


def main() -> int:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--step-times", type=Path, required=True)
    args, scheduler_argv = ours.parse_known_args()
    parser = argparse.ArgumentParser(prog="timed_scheduler")
    scheduler_main.add_arguments(parser)
    record: list[tuple[float, float, bool]] = []
    timed_steps(record)
    try:
        return scheduler_main.main(parser.parse_args(scheduler_argv))
    finally:
        steps = [{"start": start, "end": end, "work_left": left} for start, end, left in record]
        ran = {"services": str(Path(services.__file__).parent), "cpu_s": time.process_time(), "steps": steps}
        args.step_times.write_text(json.dumps(ran) + "\n")


if __name__ == "__main__":
    sys.exit(main())
