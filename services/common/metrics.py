"""What every service's Prometheus metrics share: the `sparkwire:` names, bucket ladders and a
tiny `/metrics` HTTP endpoint for the services that have no HTTP server of their own.

Names and meanings follow vLLM's (`vllm:time_to_first_token_seconds` is
`sparkwire:time_to_first_token_seconds` here), so existing dashboards need only the prefix
changed. Each service builds its metrics in a `CollectorRegistry` of its own: no global state,
and two services in one test process never share a counter.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from contracts.detokenizer import FinishType

PREFIX = "sparkwire:"


def name(metric: str) -> str:
    """`name("num_requests_running")` -> `"sparkwire:num_requests_running"`."""
    return PREFIX + metric


def finish_reason(kind: FinishType) -> str:
    """The `finished_reason` label of a finish, as vLLM spells it: "stop", "length" or "abort"."""
    return kind.name.lower()


def geometric_buckets(start: float, factor: float, count: int) -> tuple[float, ...]:
    """`count` upper bounds `start * factor**i`, rounded to 4 significant digits."""
    return tuple(float(f"{start * factor**i:.4g}") for i in range(count))


# Latency ladders from 1 ms (the tiny CPU model's steps) up to ~15 min (32k-token prompts on a busy
# server): a factor of ~2 keeps quantile error under 2x with 20-odd series per histogram.
LATENCY_BUCKETS = geometric_buckets(0.001, 2.0, 21)  # 1 ms .. ~17 min
INTER_TOKEN_BUCKETS = geometric_buckets(0.0005, 2.0, 16)  # 0.5 ms .. ~16 s
TOKEN_COUNT_BUCKETS = geometric_buckets(1, 2.0, 18)  # 1 .. 131072 tokens


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


class TrafficCounts(Protocol):
    """`transport.Traffic`: what crossed one service's NATS transport."""

    messages_sent: int
    chunks_sent: int
    bytes_sent: int
    messages_received: int
    chunks_received: int
    bytes_received: int


class BulkHistogram:
    """A Prometheus histogram of one label set fed many values at once (`observe_many`): one numpy
    pass a call where prometheus_client's `Histogram.observe` takes a lock and a bucket search per
    value. The tokenizer observes a request's inter-token gaps when it leaves, 127 of them for 128
    tokens, all the finishing requests of a wave together, in the burst the next wave's requests
    wait behind, where a lock and a search per value add up.
    Exposed as `Histogram` exposes it (`_bucket` per `le`, `_count`, `_sum`); register it in a
    registry like any collector."""

    def __init__(self, metric: str, documentation: str, labels: dict[str, str], buckets: Sequence[float]) -> None:
        self._name, self._documentation, self._labels = metric, documentation, labels
        self._upper = np.asarray(buckets, np.float64)  # the finite upper bounds, increasing
        self._counts = np.zeros(len(buckets) + 1, np.int64)  # per bucket, +Inf last
        self._sum = 0.0
        self._lock = threading.Lock()  # a scrape may come from another thread

    def observe_many(self, values: Sequence[float]) -> None:
        if not len(values):
            return
        array = np.asarray(values, np.float64)
        counts = np.bincount(np.searchsorted(self._upper, array, side="left"), minlength=len(self._counts))  # value <= le
        with self._lock:
            self._counts += counts
            self._sum += float(array.sum())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cumulative, total = np.cumsum(self._counts).tolist(), self._sum
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        bounds = [floatToGoString(b) for b in self._upper.tolist()] + ["+Inf"]
        family.add_metric(list(self._labels.values()), list(zip(bounds, cumulative, strict=True)), sum_value=total)
        yield family


class TrafficCollector:
    """`sparkwire:nats_{messages,chunks,bytes}_total{direction}`, read from the transport's
    counts at scrape time (`traffic` returns None until the transport exists)."""

    def __init__(self, traffic: Callable[[], TrafficCounts | None]) -> None:
        self._traffic = traffic

    def collect(self) -> Iterator[Metric]:
        traffic = self._traffic()
        if traffic is None:
            return
        for unit, documentation in (("messages", "NATS messages"), ("chunks", "NATS chunks (a whole message is one)"),
                                    ("bytes", "NATS payload bytes")):  # fmt: skip
            family = CounterMetricFamily(name(f"nats_{unit}"), documentation, labels=["direction"])
            for direction in ("sent", "received"):
                family.add_metric([direction], getattr(traffic, f"{unit}_{direction}"))
            yield family


class MetricsServer:
    """`GET /metrics` over plain HTTP/1.0 on its own port (scheduler, detokenizer). Anything
    else gets a 404; one response per connection. Runs on the service's event loop."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.sockets[0].getsockname()[1]

    async def start(self, host: str, port: int) -> MetricsServer:
        self._server = await asyncio.start_server(self._answer, host, port)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            writer.write(self._response(head.split(b"\r\n", 1)[0].split(b" ")))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def _response(self, request_line: Sequence[bytes]) -> bytes:
        method, target = (*request_line, b"", b"")[:2]
        if method == b"GET" and target.split(b"?")[0] == b"/metrics":
            return _http(200, "OK", CONTENT_TYPE_LATEST, render(self._registry))
        return _http(404, "Not Found", "text/plain; charset=utf-8", b"only GET /metrics is served here\n")


def _http(status: int, reason: str, content_type: str, body: bytes) -> bytes:
    head = f"HTTP/1.0 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body
