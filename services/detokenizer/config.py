"""Detokenizer configuration: one frozen dataclass, built by the CLI (`__main__.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.connection import NatsConnection


@dataclass(frozen=True)
class DetokenizerConfig:
    nats: NatsConnection
    tokenizer_path: Path  # a tokenizer.json
    instance_id: str
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: any free port (logged)

    def __post_init__(self) -> None:
        if not self.tokenizer_path.is_file():
            raise ValueError(f"tokenizer file not found: {self.tokenizer_path}")
        if not self.instance_id:
            raise ValueError("instance_id must not be empty")


def tokenizer_file(model: Path) -> Path:
    """`--model` may name a model directory (its tokenizer.json is used) or the file itself."""
    return model / "tokenizer.json" if model.is_dir() else model
