"""Recorder and replay configuration: frozen dataclasses built by the CLI (`__main__.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from contracts import subjects
from services.common.connection import NatsConnection


@dataclass(frozen=True)
class RecordConfig:
    nats: NatsConnection
    out: Path
    subject: str = subjects.ALL
    duration_s: float | None = None  # None: until SIGINT/SIGTERM

    def __post_init__(self) -> None:
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be positive")
        if not self.out.parent.is_dir():
            raise ValueError(f"output directory does not exist: {self.out.parent}")


@dataclass(frozen=True)
class ReplayConfig:
    nats: NatsConnection
    path: Path
    timing: str = "fast"  # "fast" or "original"
    only_subject: str | None = None  # NATS wildcard pattern

    def __post_init__(self) -> None:
        if self.timing not in ("fast", "original"):
            raise ValueError(f"timing must be 'fast' or 'original', not {self.timing!r}")
        if not self.path.is_file():
            raise ValueError(f"recording not found: {self.path}")
