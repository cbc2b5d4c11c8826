"""The detokenizer's metrics (`sparkwire:` prefix), its `/metrics` endpoint and request-id lines.

Token batches carry many requests, so the request id of each (sent once, in the registration's
`Sw-Request-Id` header) is remembered here until the request finishes or is forgotten; the
lines about a request (registered, finished) carry it like every other service's lines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from contracts.detokenizer import TokenBatch
from contracts.tokenizer import TextBatch
from services.common.arrays import from_wire
from services.common.logging import bound_request_id
from services.common.metrics import MetricsServer, TrafficCollector, TrafficCounts, finish_reason, name

log = structlog.get_logger(__name__)



@dataclass
class DetokenizerTelemetry:
    num_running: Callable[[], int] | None = None  # requests held, read at scrape time
    traffic: Callable[[], TrafficCounts | None] = lambda: None  # the transport's counts
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _request_ids: dict[str, str] = field(default_factory=dict)  # rid -> request id, while held
    _server: MetricsServer | None = None

    def __post_init__(self) -> None:
        r = self.registry
        self.registrations = Counter(name("detokenizer_registrations"), "Requests registered", registry=r)
        self.token_batches = Counter(name("detokenizer_token_batches"), "Token batches processed", registry=r)
        self.tokens = Counter(name("detokenizer_tokens"), "Token ids detokenized", registry=r)
        self.text_batches = Counter(name("detokenizer_text_batches"), "Text batches published", registry=r)
        self.stop_aborts = Counter(name("detokenizer_stop_string_matches"), "Requests ended by a stop string", registry=r)
        self.finished = Counter(
            name("detokenizer_requests_finished"), "Requests finished, by finished_reason", ["finished_reason"], registry=r
        )
        running = Gauge(name("detokenizer_num_requests"), "Requests whose text state this replica holds", registry=r)
        r.register(TrafficCollector(self.traffic))
        if self.num_running is not None:
            running.set_function(self.num_running)

    async def start(self, host: str, port: int | None) -> None:
        if port is not None:
            self._server = await MetricsServer(self.registry).start(host, port)
            log.info("detokenizer.metrics", url=f"http://{host}:{self._server.port}/metrics")

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()

    def registered(self, rid: str, request_id: str | None) -> None:
        self.registrations.inc()
        if request_id:
            self._request_ids[rid] = request_id
        with bound_request_id(request_id):
            log.info("detokenizer.registered", rid=rid)

    def processed(self, batch: TokenBatch, outputs: Iterable[TextBatch], num_stop_aborts: int) -> None:
        self.token_batches.inc()
        self.tokens.inc(int(batch.new_token_ids.shape[0]))
        self.stop_aborts.inc(num_stop_aborts)
        for text_batch in outputs:
            self.text_batches.inc()
            for rid, finish, count in zip(text_batch.rids, text_batch.finish, from_wire(text_batch.num_new_tokens).tolist()):
                if finish is not None:
                    self._finished(rid, finish_reason(finish.type), count)

    def _finished(self, rid: str, reason: str, last_tokens: int) -> None:
        self.finished.labels(reason).inc()
        with bound_request_id(self._request_ids.pop(rid, None)):
            log.info("detokenizer.finished", rid=rid, finished_reason=reason, last_tokens=last_tokens)

    def forgotten(self, rids: Iterable[str]) -> None:
        """Requests dropped without a finish (scheduler dead, aborted before any token)."""
        for rid in rids:
            self._request_ids.pop(rid, None)
