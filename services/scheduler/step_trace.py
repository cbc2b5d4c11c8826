"""The step trace (`--step-trace DIR`): one JSON line per scheduler step, for finding where the
device's time goes while serving (`ops/bench/step_trace_summary.py` reads it).

Written by the step thread as it steps, to `DIR/<instance id>.jsonl`, one object per step:
    t          when the step began, on time.monotonic()'s clock (CLOCK_MONOTONIC on Linux: the same
               clock in every process of the machine, so a client can cut out its own window)
    dur_s      the step's wall time (`core.step`)
    turn_s     how long the thread waited before it, and why: `held` (the step ahead was not yet
               published: the event loop is behind) or not (no work had arrived)
    num_seqs, num_tokens, num_prefill_tokens, num_sampling, followed, follows, collect_s, wait_s:
               `core.StepRecord`
    running, waiting: the policy's counts after the step
    queued_s   for each request this step scheduled first: seconds from its arrival at this
               scheduler (`add`) until then (absent when none)
A step that planned nothing (only finishes to hand on) has no `num_seqs`. The trace costs a dict
and a flushed write (a syscall) per step; it is off unless asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import msgspec

from services.scheduler.step_counts import StepRecord


class StepTrace:
    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self._encode = msgspec.json.Encoder().encode

    @classmethod
    def open(cls, directory: str | Path, instance_id: str) -> StepTrace:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        return cls((path / f"{instance_id}.jsonl").open("wb"))

    def write(self, begin: float, end: float, turn_s: float, held: bool, record: StepRecord | None,
              num_running: int, num_waiting: int, queued_s: Sequence[float] = ()) -> None:  # fmt: skip
        """begin, end: time.monotonic() around the step. Flushed at once: a reader may cut the
        trace while the scheduler runs (a syscall a step, for a trace asked for)."""
        line = {"t": round(begin, 6), "dur_s": round(end - begin, 6), "turn_s": round(turn_s, 6), "held": held}
        if record is not None:
            line |= dataclasses.asdict(record)
        line |= {"running": num_running, "waiting": num_waiting}
        if queued_s:
            line["queued_s"] = [round(seconds, 6) for seconds in queued_s]
        self._file.write(self._encode(line) + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
