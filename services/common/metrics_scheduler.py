"""The scheduler's Prometheus metrics and its periodic engine line, from a small stats snapshot.

The scheduler adapter hands over two things: a `stats()` callable returning a `SchedulerStats`
(read at scrape time and by the engine line, so gauges are never stale) and each step's
outputs (`observe_step`: generated tokens, finished requests). The snapshot's cumulative
counts become Prometheus counters here; the core only counts.

vLLM's meanings: `num_requests_running` are requests being decoded or prefilled this step,
`num_requests_waiting` those queued for admission, `kv_cache_usage_perc` the fraction (0..1) of
KV blocks in use, `num_preemptions_total` requests evicted and later re-prefilled,
`request_queue_time_seconds` the time from a request's arrival at this scheduler until a step
first schedules it (observed then, once per request; vLLM observes the same span at finish);
speculative decoding counts drafts (verify passes), draft tokens proposed and draft tokens accepted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from contracts.detokenizer import Finish, FinishType
from services.common.metrics import (
    LATENCY_BUCKETS,
    TOKEN_COUNT_BUCKETS,
    MetricsServer,
    TrafficCollector,
    TrafficCounts,
    finish_reason,
    name,
    render,
)

log = structlog.get_logger(__name__)

ENGINE_LOG_INTERVAL_S = 10.0  # as vLLM's default


@dataclass(frozen=True)
class SchedulerStats:
    """One look at the scheduler. Cumulative counts only grow; None: this core cannot tell."""

    num_running: int
    num_waiting: int | None = None
    kv_cache_usage: float | None = None  # fraction of KV blocks in use, 0..1
    num_preemptions: int = 0
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_prompt_tokens: int | None = None  # prompt tokens computed (prefill, re-prefills included)
    num_generated_tokens: int | None = None
    spec_accept_lengths: tuple[int, ...] = ()  # verify passes by tokens gained (index = tokens, bonus included)
    forward_seconds: float = 0.0  # target forward + verify, summed over steps (device time on CUDA)
    draft_seconds: float = 0.0  # drafter inject + propose, summed over steps
    num_prefix_cache_queries: int = 0  # prompt tokens of the requests added
    num_prefix_cache_hits: int = 0  # of those, tokens whose KV was found computed (prefix cache, forked choices)


class StepOutput(Protocol):
    """What `observe_step` reads of a scheduler step's per-request output."""

    new_token_ids: list[int]
    prompt_tokens: int
    finish: Finish | None


class _SnapshotCollector:
    """Gauges and cumulative counters straight from `stats()` at every scrape."""

    def __init__(self, stats: Callable[[], SchedulerStats], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield self._gauge("num_requests_running", "Requests in the running batch", stats.num_running)
        if stats.num_waiting is not None:
            yield self._gauge("num_requests_waiting", "Requests waiting for admission", stats.num_waiting)
        if stats.kv_cache_usage is not None:
            yield self._gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)", stats.kv_cache_usage)
        counters = (
            ("num_preemptions", "Requests preempted (their KV freed, re-prefilled later)", stats.num_preemptions),
            ("spec_decode_num_drafts", "Speculative verify passes", stats.num_spec_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed", stats.num_spec_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted", stats.num_spec_accepted_tokens),
            ("prefix_cache_queries", "Prompt tokens of the requests added", stats.num_prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens whose KV was found computed, not computed again (the prefix cache, "
                                  "the forked choices of n > 1)",
             stats.num_prefix_cache_hits),
        )
        counters += (
            ("spec_decode_verify_seconds", "Target forward + verify time of the steps", stats.forward_seconds),
            ("spec_decode_draft_seconds", "Drafter inject + propose time of the steps", stats.draft_seconds),
        ) if stats.spec_accept_lengths else ()  # fmt: skip
        for metric, documentation, value in counters:
            family = CounterMetricFamily(name(metric), documentation, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family
        if stats.spec_accept_lengths:
            yield self._accept_length_histogram(stats.spec_accept_lengths)

    def _accept_length_histogram(self, counts: tuple[int, ...]) -> HistogramMetricFamily:
        """Tokens gained per verify pass (accepted drafts + the bonus), one bucket per length."""
        family = HistogramMetricFamily(name("spec_decode_accept_length"), "Tokens gained per verify pass", labels=["model_name"])
        cumulative, buckets = 0, []
        for length, count in enumerate(counts):
            cumulative += count
            buckets.append((str(float(length)), cumulative))
        buckets.append(("+Inf", cumulative))
        total = sum(length * count for length, count in enumerate(counts))
        family.add_metric([self._model], buckets, sum_value=total)
        return family

    def _gauge(self, metric: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name(metric), documentation, labels=["model_name"])
        family.add_metric([self._model], value)
        return family


@dataclass
class SchedulerMetrics:
    stats: Callable[[], SchedulerStats]
    model_name: str = ""
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        model, r = ["model_name"], self.registry
        r.register(_SnapshotCollector(self.stats, self.model_name))
        self.prompt_tokens = Counter(name("prompt_tokens"), "Prompt tokens of finished requests", model, registry=r)
        self.generation_tokens = Counter(name("generation_tokens"), "Tokens generated", model, registry=r)
        self.request_success = Counter(
            name("request_success"), "Finished requests by finished_reason", [*model, "finished_reason"], registry=r
        )
        self.iteration_tokens = Histogram(
            name("iteration_tokens_total"), "Tokens generated per scheduler step", model,
            buckets=TOKEN_COUNT_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            name("request_queue_time_seconds"), "From arrival at this scheduler until first scheduled (its first "
            "prefill chunk)", model, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.num_generated_tokens = 0  # the counters' totals, for the engine line
        self.num_prompt_tokens = 0

    def observe_step(self, outputs: Iterable[StepOutput]) -> None:
        generated = 0
        for output in outputs:
            generated += len(output.new_token_ids)
            if output.finish is not None:
                self.request_success.labels(self.model_name, _finished_reason(output.finish)).inc()
                self.prompt_tokens.labels(self.model_name).inc(output.prompt_tokens)
                self.num_prompt_tokens += output.prompt_tokens
        self.num_generated_tokens += generated
        self.generation_tokens.labels(self.model_name).inc(generated)
        self.iteration_tokens.labels(self.model_name).observe(generated)

    def observe_queue_times(self, seconds: Iterable[float]) -> None:
        for value in seconds:
            self.queue_time.labels(self.model_name).observe(value)

    def render(self) -> bytes:
        return render(self.registry)


def _finished_reason(finish: Finish) -> str:
    """A stop string ends a request at the detokenizer, which aborts it here with reason "stop":
    vLLM counts that as a stop, not an abort."""
    stopped = finish.type is FinishType.ABORT and finish.message == "stop"
    return "stop" if stopped else finish_reason(finish.type)


@dataclass
class EngineLine:
    """The periodic "what is the engine doing" line (vLLM prints one every 10 s): throughput
    since the previous line, running/waiting requests, KV use. Silent while idle."""

    metrics: SchedulerMetrics
    _last_at: float = field(default_factory=time.monotonic)
    _last_tokens: int = 0
    _last_prompt: int = 0

    def fields(self, now: float | None = None) -> dict[str, float | int | None] | None:
        now = time.monotonic() if now is None else now
        stats = self.metrics.stats()
        # The core's own counts when it has them (prefill as it is computed), else ours (at finish).
        tokens = _first_known(stats.num_generated_tokens, self.metrics.num_generated_tokens)
        prompt = _first_known(stats.num_prompt_tokens, self.metrics.num_prompt_tokens)
        elapsed = max(now - self._last_at, 1e-9)
        idle = tokens == self._last_tokens and stats.num_running == 0 and not stats.num_waiting
        line = {
            "generation_tokens_per_s": round((tokens - self._last_tokens) / elapsed, 1),
            "prompt_tokens_per_s": round((prompt - self._last_prompt) / elapsed, 1),
            "running": stats.num_running, "waiting": stats.num_waiting,
            "kv_cache_usage": None if stats.kv_cache_usage is None else round(stats.kv_cache_usage, 4),
            "preemptions": stats.num_preemptions,
        }  # fmt: skip
        self._last_at, self._last_tokens, self._last_prompt = now, tokens, prompt
        return None if idle else line

    def log(self) -> None:
        line = self.fields()
        if line is not None:
            log.info("engine.stats", **line)


def _first_known(value: int | None, fallback: int) -> int:
    return fallback if value is None else value


class SchedulerTelemetry:
    """All a scheduler adapter holds for observability: metrics, their `/metrics` endpoint (when
    a port is given) and the periodic engine line. Calls: start, observe_step, observe_queue_times, close."""

    def __init__(
        self, stats: Callable[[], SchedulerStats], model_name: str, interval_s: float = ENGINE_LOG_INTERVAL_S,
        traffic: Callable[[], TrafficCounts | None] = lambda: None,
    ) -> None:  # fmt: skip
        self.metrics = SchedulerMetrics(stats, model_name)
        self.metrics.registry.register(TrafficCollector(traffic))
        self._line = EngineLine(self.metrics)
        self._interval_s = interval_s
        self._server: MetricsServer | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int | None:
        """Where `/metrics` listens (None: not served)."""
        return None if self._server is None else self._server.port

    async def start(self, host: str, port: int | None) -> None:
        if port is not None:
            self._server = await MetricsServer(self.metrics.registry).start(host, port)
            log.info("scheduler.metrics", url=f"http://{host}:{self._server.port}/metrics")
        self._task = asyncio.create_task(self._log_periodically(), name="scheduler-engine-line")

    def observe_step(self, outputs: Iterable[StepOutput]) -> None:
        self.metrics.observe_step(outputs)

    def observe_queue_times(self, seconds: Iterable[float]) -> None:
        self.metrics.observe_queue_times(seconds)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._server is not None:
            await self._server.close()

    async def _log_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            self._line.log()
