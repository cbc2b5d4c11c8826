"""What `sparkwire up` (services/launcher.py) supervises: a `Child`, one service process whose
output is relayed to our stderr line by line, prefixed with its name (`write_line`: one write a
line, so two children's lines never run together), its last lines kept for the report; and the
`Backoff` that paces a process's restarts and says when to give up. Apart from the launcher,
which decides what runs, in what order, and when it all stops.
"""

from __future__ import annotations

import collections
import contextlib
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

OUTPUT_TAIL_LINES = 20
FIRST_RESTART_WAIT_S = 0.5
MAX_RESTART_WAIT_S = 30.0
STABLE_AFTER_S = 60.0  # up this long: the next crash is a first one again
MAX_RESTARTS_IN_A_ROW = 8  # without staying up STABLE_AFTER_S in between: give up


@dataclass
class Child:
    """One service process; its output (stdout + stderr, where structlog and tracebacks go) is
    echoed to our stderr, prefixed with its name, and the last lines are kept for the report."""

    name: str
    process: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=OUTPUT_TAIL_LINES))
    reader: threading.Thread | None = None
    started_at: float = field(default_factory=time.monotonic)
    ready_prefix: str | None = None  # a line starting with this sets `ready`
    ready: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(cls, name: str, argv: list[str], env: dict[str, str], ready_prefix: str | None = None) -> Child:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        child = cls(name, process, ready_prefix=ready_prefix)
        child.reader = threading.Thread(target=child._echo_output, name=f"{name}-output", daemon=True)
        child.reader.start()
        return child

    def _echo_output(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            if self.ready_prefix is not None and line.startswith(self.ready_prefix):
                self.ready.set()
            with contextlib.suppress(OSError, ValueError):  # our stderr gone: keep draining the pipe
                write_line(f"[{self.name}] {line}")

    def exit_code(self) -> int | None:
        return self.process.poll()

    def report(self) -> str:
        if self.reader is not None:
            self.reader.join(timeout=2.0)  # the last lines are the ones that explain the exit
        lines = "\n".join(f"    {line}" for line in self.tail) or "    (no output)"
        return f"sparkwire up: {self.name} exited with code {self.exit_code()}; last output lines:\n{lines}"


@dataclass
class Backoff:
    """Restarts of one process: how long to wait before the next, and when to give up."""

    in_a_row: int = 0
    due_at: float | None = None  # a restart is scheduled for then

    def schedule(self, up_for_s: float) -> float:
        """Plan the next restart of a process that ran `up_for_s`; returns the wait."""
        if up_for_s >= STABLE_AFTER_S:
            self.in_a_row = 0
        wait = min(MAX_RESTART_WAIT_S, FIRST_RESTART_WAIT_S * 2**self.in_a_row)
        self.in_a_row += 1
        self.due_at = time.monotonic() + wait
        return wait

    def is_due(self) -> bool:
        return self.due_at is not None and time.monotonic() >= self.due_at

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= MAX_RESTARTS_IN_A_ROW


def write_line(text: str) -> None:
    """One line to stderr in one write: every child's output is relayed by its own thread, and
    print's separate write of the newline let two children's lines run together (unbuffered
    stderr: "[tokenizer] a[tokenizer-2] b", then two newlines)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
