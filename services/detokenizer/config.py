"""Detokenizer configuration: one frozen dataclass, built by the CLI (`__main__.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DetokenizerConfig:
    nats_url: str
    tokenizer_path: Path  # a tokenizer.json
    instance_id: str
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 2.0
    drain_timeout_s: float = 8.0  # on shutdown, finish the requests we hold for at most this long

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ValueError("nats_url is required")
        if not self.tokenizer_path.is_file():
            raise ValueError(f"tokenizer file not found: {self.tokenizer_path}")
        if not self.instance_id:
            raise ValueError("instance_id must not be empty")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")


def tokenizer_file(model: Path) -> Path:
    """`--model` may name a model directory (its tokenizer.json is used) or the file itself."""
    return model / "tokenizer.json" if model.is_dir() else model
