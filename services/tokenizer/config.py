"""The tokenizer service's one config: built by `__main__` from CLI flags, validated here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.connection import NatsConnection


@dataclass(frozen=True)
class TokenizerConfig:
    model_dir: Path
    nats: NatsConnection
    instance_id: str
    host: str = "127.0.0.1"
    port: int = 8000
    reuse_port: bool = False  # SO_REUSEPORT: several tokenizers on one port, connections spread by the kernel (Linux)
    served_model_name: str = ""  # empty: the model directory's name
    max_model_len: int | None = None  # None: config.json `max_position_embeddings`
    max_logprobs: int = 20  # upper bound of `logprobs`, `top_logprobs`, `top_logprobs_num`
    request_timeout_s: float = 5.0  # NATS request/reply (claims, registration)
    claim_wait_s: float = 30.0  # every scheduler busy this long: the next one takes it anyway
    health_timeout_s: float = 1.0  # /health waits this long for a scheduler to answer a ping
    log_level: str = "info"
    api_key: str | None = None  # set: every route but /health needs `Authorization: Bearer <key>`
    metrics_require_api_key: bool = False  # /metrics too needs the key (scrapers often send none)
    metrics_dir: Path | None = None  # set: /metrics answers the sum of every tokenizer publishing here
    tokenizer_dir: Path | None = None  # --tokenizer: tokenizer.json and tokenizer_config.json from here
    chat_template: str | None = None  # --chat-template: this jinja source instead of the tokenizer's

    def __post_init__(self) -> None:
        if not (self.text_dir / "tokenizer.json").is_file():
            raise ValueError(f"{self.text_dir} has no tokenizer.json")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.max_logprobs < 0:
            raise ValueError("max_logprobs must be >= 0")
        for name in ("request_timeout_s", "health_timeout_s", "claim_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    @property
    def text_dir(self) -> Path:
        """Where the tokenizer's files are: --tokenizer, else the model directory."""
        return self.tokenizer_dir or self.model_dir

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir.name
