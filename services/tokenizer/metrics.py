"""Prometheus metrics of one tokenizer replica, in a registry of its own (no global state)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.requests = Counter(
            "sparkwire_http_requests", "HTTP requests by path and status", ["path", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "sparkwire_request_latency_seconds", "End-to-end latency of generation requests", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.prompt_tokens = Counter("sparkwire_prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.generation_tokens = Counter("sparkwire_generation_tokens", "Tokens generated", registry=self.registry)

    def observe_generation(self, endpoint: str, latency_s: float, prompt_tokens: int, completion_tokens: int) -> None:
        self.latency.labels(endpoint).observe(latency_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
