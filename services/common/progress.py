"""Progress of a long start-up task (model load, CUDA-graph capture), counted in items.

Where a person watches — console logs on a terminal — it is a tqdm bar on stderr. Everywhere
else it is log records, so JSON logs stay JSON and a log file is not filled with bar redraws:
`<event>.progress` at most every `min_interval_s` (the first item always), then `<event>.done`
with the totals and the duration, in both modes.

    progress = Progress("model.load", "tensors", len(tensors), total_bytes=nbytes)
    for tensor in tensors:
        ...
        progress.advance(num_bytes=tensor.nbytes)
    progress.close()
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import structlog

LOG_INTERVAL_S = 5.0  # between progress records when there is no bar


def json_logs() -> bool:
    """Whether `configure_logging` chose JSON lines (read from structlog's renderer, no state of ours)."""
    processors = structlog.get_config()["processors"]
    return bool(processors) and isinstance(processors[-1], structlog.processors.JSONRenderer)


def wants_bar(stream: TextIO) -> bool:
    return not json_logs() and stream.isatty()


class Progress:
    def __init__(
        self, event: str, items: str, num_items: int, *, total_bytes: int | None = None,
        min_interval_s: float | None = None, stream: TextIO | None = None, **fields: Any,
    ) -> None:  # fmt: skip
        self.event, self.items, self.num_items, self.total_bytes = event, items, num_items, total_bytes
        self.num_done, self.num_bytes = 0, 0
        self._fields = fields
        self._log = structlog.get_logger("sparkwire.progress")
        self._interval_s = LOG_INTERVAL_S if min_interval_s is None else min_interval_s
        self._started = self._last_record = time.monotonic()
        stream = sys.stderr if stream is None else stream
        self._bar = _bar(event, items, num_items, total_bytes, stream) if wants_bar(stream) else None

    def advance(self, num_bytes: int = 0, **fields: Any) -> None:
        """One more item done (of `num_bytes`); `fields` describe it (a tensor's name, a rung)."""
        self.num_done += 1
        self.num_bytes += num_bytes
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.items} {self.num_done}/{self.num_items}", refresh=False)
            self._bar.update(num_bytes if self.total_bytes is not None else 1)
            return
        now = time.monotonic()
        if self.num_done == 1 or now - self._last_record >= self._interval_s:
            self._last_record = now
            self._log.info(f"{self.event}.progress", **self._counts(), **self._fields, **fields)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        seconds = round(time.monotonic() - self._started, 2)
        self._log.info(f"{self.event}.done", **self._counts(), seconds=seconds, **self._fields)

    def _counts(self) -> dict[str, int]:
        counts = {self.items: self.num_done, f"num_{self.items}": self.num_items}
        if self.total_bytes is not None:
            counts |= {"bytes": self.num_bytes, "total_bytes": self.total_bytes}
        return counts


def _bar(event: str, items: str, num_items: int, total_bytes: int | None, stream: TextIO):
    from tqdm import tqdm  # the scheduler extra; only a terminal needs it

    if total_bytes is not None:
        return tqdm(total=total_bytes, desc=event, unit="B", unit_scale=True, unit_divisor=1024, file=stream)
    return tqdm(total=num_items, desc=event, unit=items, file=stream)
