"""Prometheus metrics of one tokenizer replica (vLLM's names and meanings, `sparkwire:` prefix).

Every request is observed once, when it leaves the pending table (finished, failed or aborted),
whatever the endpoint and whether it streamed; HTTP requests are counted per route template
(`/v1/completions`), never per raw path, so unknown paths cannot grow the series without bound.

vLLM's engine counters (`prompt_tokens_total`, `generation_tokens_total`, `request_success_total`)
are the scheduler's alone: what the front end counts of the same requests is named for the
tokenizer (`tokenizer_*`: what its clients were answered), so no sum across services counts a
token twice. With `shared` set (several tokenizers on one port), `render` answers the sum of
every tokenizer's counts (services/common/metrics_shared.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common.metrics import INTER_TOKEN_BUCKETS, LATENCY_BUCKETS, TOKEN_COUNT_BUCKETS, BulkHistogram, name, render
from services.common.metrics_shared import SharedMetricsDir
from services.tokenizer.requests import PendingRequest

UNMATCHED_ROUTE = "<unmatched>"  # the handler label of requests no route matched (404s)


@dataclass
class Metrics:
    model_name: str = ""
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    shared: SharedMetricsDir | None = None  # set: /metrics sums every tokenizer publishing there

    def __post_init__(self) -> None:
        model, r = ["model_name"], self.registry
        self.http_requests = Counter(
            name("http_requests"), "HTTP requests by route template, method and status", ["handler", "method", "status"],
            registry=r,
        )  # fmt: skip
        self.http_latency = Histogram(
            name("http_request_duration_seconds"), "HTTP request duration until the response started (streams: "
            "until their headers)", ["handler", "method"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            name("tokenizer_prompt_tokens"), "Prompt tokens of the requests answered (usage.prompt_tokens)", model, registry=r
        )
        self.generation_tokens = Counter(
            name("tokenizer_generation_tokens"), "Output tokens the answers carried (after stop strings were cut)", model,
            registry=r,
        )  # fmt: skip
        self.requests_finished = Counter(
            name("tokenizer_requests_finished"), "Requests that left the front end, by finished_reason (stop, length, "
            "abort, error: failed before or without a scheduler's answer)", [*model, "finished_reason"], registry=r,
        )  # fmt: skip
        self.ttft = self._histogram("time_to_first_token_seconds", "From arrival to the first token", LATENCY_BUCKETS)
        self.itl = BulkHistogram(name("inter_token_latency_seconds"), "Between successive token deliveries",
                                 {"model_name": self.model_name}, INTER_TOKEN_BUCKETS)  # fmt: skip
        r.register(self.itl)
        self.e2e = self._histogram("e2e_request_latency_seconds", "From arrival to the last token", LATENCY_BUCKETS)
        # Not vLLM's queue time: that one (arrival at the engine until first scheduled) is the
        # scheduler's `request_queue_time_seconds`; this is the front end's part before it.
        self.placement = self._histogram(
            "request_placement_time_seconds", "From arrival until a scheduler holds the request (detokenizer "
            "registration, scheduler claim, submit); the scheduler's request_queue_time_seconds follows it",
            LATENCY_BUCKETS,
        )  # fmt: skip
        self.prompt_len = self._histogram("request_prompt_tokens", "Prompt length per request", TOKEN_COUNT_BUCKETS)
        self.generation_len = self._histogram("request_generation_tokens", "Tokens generated per request", TOKEN_COUNT_BUCKETS)

    def _histogram(self, metric: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name(metric), documentation, ["model_name"], buckets=buckets, registry=self.registry)

    def observe_http(self, handler: str, method: str, status: int, duration_s: float) -> None:
        self.http_requests.labels(handler, method, str(status)).inc()
        self.http_latency.labels(handler, method).observe(duration_s)

    def observe_request(self, pending: PendingRequest) -> None:
        """One request left the pending table: count its tokens, outcome and timings."""
        model, timing = self.model_name, pending.timing
        self.requests_finished.labels(model, pending.outcome).inc()
        self.prompt_tokens.labels(model).inc(pending.prompt_tokens)
        self.generation_tokens.labels(model).inc(timing.num_output_tokens)
        self.prompt_len.labels(model).observe(pending.prompt_tokens)
        self.generation_len.labels(model).observe(timing.num_output_tokens)
        self.e2e.labels(model).observe(timing.e2e_s())
        if timing.submitted_at is not None:
            self.placement.labels(model).observe(timing.submitted_at - timing.arrived_at)
        if timing.first_token_at is not None:
            self.ttft.labels(model).observe(timing.first_token_at - timing.arrived_at)
        self.itl.observe_many(timing.gaps)

    def render(self) -> bytes:
        return render(self.registry) if self.shared is None else self.shared.render()
