"""Per-request state on the tokenizer: the deltas a detokenizer sends back, dispatched by rid.

`PendingRequests` is a plain object (no NATS): the service feeds it `TextBatch`es and liveness
news, HTTP handlers consume each request's queue. A request leaves the table when its finish
arrives, when it fails, or when its client goes away; then (and only then) `on_done` sees it,
once, with its outcome and timings: that is where metrics and the one-line summary come from.

A handler that falls behind its request (the tokenizer busy with other streams while steps keep
coming) takes every delta waiting in the queue at once, merged into one (`merge_deltas`): one SSE
event for several steps' tokens instead of one each, so a loaded front end formats fewer, larger
events rather than falling further behind, as SGLang's and vLLM's front ends merge outputs their
client has not read yet. A handler that keeps up still sends one event per step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from contracts.detokenizer import Finish
from contracts.tokenizer import TextBatch
from services.common.arrays import from_wire
from services.common.logprob_rows import RequestLogprobs, from_columns
from services.common.metrics import finish_reason
from services.tokenizer.invalid import InvalidRequest
from services.tokenizer.validation import GenerationSpec


class RequestFailed(Exception):
    """The request cannot finish: its scheduler or detokenizer died, or the service stopped."""


@dataclass(frozen=True)
class Delta:
    """What one TextBatch (or several in a row, merged: `merge_deltas`) carried for one request."""

    text: str
    token_ids: list[int]  # [n]
    prompt_tokens: int
    finish: Finish | None
    logprobs: tuple[RequestLogprobs, ...]  # each TextBatch's entries for the request, in arrival order
    spec_verify_ct: int | None  # the request's verify steps so far (cumulative)
    cached_tokens: int = 0  # prompt tokens the scheduler found in KV (a running total too)
    weight_version: str | None = None  # the weights that produced it


def merge_deltas(deltas: list[Delta]) -> Delta:
    """Consecutive deltas of one request as one: text and token ids joined, logprob entries kept in
    order, the newest counts and finish (prompt_tokens and spec_verify_ct are running totals)."""
    if len(deltas) == 1:
        return deltas[0]
    return Delta(
        "".join(d.text for d in deltas),
        [token for d in deltas for token in d.token_ids],
        next((d.prompt_tokens for d in reversed(deltas) if d.prompt_tokens), 0),
        deltas[-1].finish,
        tuple(entries for d in deltas for entries in d.logprobs),
        next((d.spec_verify_ct for d in reversed(deltas) if d.spec_verify_ct is not None), None),
        max(d.cached_tokens for d in deltas),
        next((d.weight_version for d in reversed(deltas) if d.weight_version is not None), None),
    )


@dataclass(frozen=True)
class Failure:
    message: str


@dataclass
class RequestTiming:
    """Monotonic timestamps of one request, for TTFT, inter-token latency, placement and e2e time."""

    arrived_at: float = field(default_factory=time.monotonic)
    submitted_at: float | None = None  # a scheduler holds it (claimed and published)
    first_token_at: float | None = None
    last_token_at: float | None = None
    left_at: float | None = None  # left the pending table
    num_output_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # between successive deliveries with tokens

    def tokens_arrived(self, count: int, now: float) -> None:
        if count == 0:
            return
        if self.last_token_at is not None:
            self.gaps.append(now - self.last_token_at)
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        self.num_output_tokens += count

    def e2e_s(self) -> float:
        return (self.left_at or time.monotonic()) - self.arrived_at


@dataclass
class PendingRequest:
    spec: GenerationSpec
    timing: RequestTiming = field(default_factory=RequestTiming)
    scheduler_id: str = ""
    detokenizer_id: str = ""
    finished: bool = False
    prompt_tokens: int = 0
    outcome: str = ""  # once it left: "stop", "length", "abort" (client gone or aborted) or "error"
    queue: asyncio.Queue[Delta | Failure] = field(default_factory=asyncio.Queue)

    @property
    def rid(self) -> str:
        return self.spec.rid

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every delta up to and including the finishing one, those already waiting merged into one
        (the module's docstring says why); raises `RequestFailed` after the deltas before it."""
        while True:
            item = await self.queue.get()
            if isinstance(item, Failure):
                raise RequestFailed(item.message)
            waiting, failure = self._take_waiting(item)
            delta = merge_deltas(waiting)
            yield delta
            if failure is not None:
                raise RequestFailed(failure.message)
            if delta.finish is not None:
                return

    def _take_waiting(self, first: Delta) -> tuple[list[Delta], Failure | None]:
        """`first` and the deltas queued behind it, up to a finish or a failure (returned apart)."""
        waiting = [first]
        while waiting[-1].finish is None and not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, Failure):
                return waiting, item
            waiting.append(item)
        return waiting, None


OnDone = Callable[[PendingRequest], None]


class PendingRequests:
    def __init__(self, on_done: OnDone | None = None) -> None:
        self._by_rid: dict[str, PendingRequest] = {}
        self._on_done = on_done

    def __len__(self) -> int:
        return len(self._by_rid)

    def add(self, spec: GenerationSpec) -> PendingRequest:
        if spec.rid in self._by_rid:
            raise InvalidRequest(f"rid {spec.rid!r} is already in use", "rid")
        pending = PendingRequest(spec, prompt_tokens=len(spec.prompt_ids))
        self._by_rid[spec.rid] = pending
        return pending

    def remove(self, rid: str, outcome: str | None = "abort") -> PendingRequest | None:
        """Take `rid` out of the table; `outcome` None: it never reached a scheduler (not counted)."""
        pending = self._by_rid.pop(rid, None)
        if pending is not None and outcome is not None:
            pending.outcome = outcome
            pending.timing.left_at = time.monotonic()
            if self._on_done is not None:
                self._on_done(pending)
        return pending

    def dispatch(self, batch: TextBatch) -> None:
        counts = from_wire(batch.num_new_tokens).tolist()  # [R]
        token_ids = from_wire(batch.new_token_ids).tolist()  # [sum(counts)]
        prompt_tokens = from_wire(batch.prompt_tokens).tolist()  # [R]
        verify = from_wire(batch.spec_verify_ct).tolist() if batch.spec_verify_ct is not None else None
        cached = from_wire(batch.cached_tokens).tolist() if batch.cached_tokens is not None else [0] * len(batch.rids)
        logprobs = _request_logprobs(batch)
        start = 0
        for i, rid in enumerate(batch.rids):
            end = start + counts[i]
            pending = self._by_rid.get(rid)
            if pending is not None:
                ct = verify[i] if verify is not None else None
                entries = (logprobs[i],) if logprobs[i] is not None else ()
                delta = Delta(batch.text_deltas[i], token_ids[start:end], prompt_tokens[i], batch.finish[i], entries, ct,
                              cached[i], batch.weight_version)  # fmt: skip
                self._push(pending, delta)
            start = end

    def _push(self, pending: PendingRequest, delta: Delta) -> None:
        pending.timing.tokens_arrived(len(delta.token_ids), time.monotonic())
        pending.prompt_tokens = delta.prompt_tokens or pending.prompt_tokens
        pending.queue.put_nowait(delta)
        if delta.finish is not None:
            pending.finished = True
            self.remove(pending.rid, finish_reason(delta.finish.type))

    def fail(self, select: Callable[[PendingRequest], bool], message: str) -> list[str]:
        """Fail every pending request `select` picks; returns their rids."""
        failed = [p for p in self._by_rid.values() if select(p)]
        for pending in failed:
            self.remove(pending.rid, "error")
            pending.queue.put_nowait(Failure(message))
        return [p.rid for p in failed]

    def fail_owned_by(self, instance_id: str, message: str) -> list[str]:
        return self.fail(lambda p: instance_id in (p.scheduler_id, p.detokenizer_id), message)


def _request_logprobs(batch: TextBatch) -> list[RequestLogprobs | None]:
    """Each request's rows of the batch's logprob columns (None: none), views of the received bytes."""
    count = len(batch.rids)
    if batch.output_logprobs is None and batch.prompt_logprobs is None and batch.prompt_top_flat is None:
        return [None] * count
    kinds = zip(*(from_columns(columns, count) for columns in (batch.output_logprobs, batch.prompt_logprobs, batch.prompt_top_flat)))
    return [None if rows == (None, None, None) else RequestLogprobs(*rows) for rows in kinds]
