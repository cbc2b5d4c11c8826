"""Per-request state on the tokenizer: the deltas a detokenizer sends back, dispatched by rid.

`PendingRequests` is a plain object (no NATS): the service feeds it `TextBatch`es and liveness
news, HTTP handlers consume each request's queue. A request leaves the table when its finish
arrives, when it fails, or when its client goes away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from contracts.detokenizer import Finish, RequestLogprobs
from contracts.tokenizer import TextBatch
from services.common.arrays import from_wire
from services.tokenizer.validation import GenerationSpec, InvalidRequest


class RequestFailed(Exception):
    """The request cannot finish: its scheduler or detokenizer died, or the service stopped."""


@dataclass(frozen=True)
class Delta:
    """What one TextBatch carried for one request."""

    text: str
    token_ids: list[int]  # [n]
    prompt_tokens: int
    finish: Finish | None
    logprobs: RequestLogprobs | None
    spec_verify_ct: int | None


@dataclass(frozen=True)
class Failure:
    message: str


@dataclass
class PendingRequest:
    spec: GenerationSpec
    created_at: float = field(default_factory=time.monotonic)
    scheduler_id: str = ""
    detokenizer_id: str = ""
    finished: bool = False
    queue: asyncio.Queue[Delta | Failure] = field(default_factory=asyncio.Queue)

    @property
    def rid(self) -> str:
        return self.spec.rid

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every delta up to and including the finishing one; raises `RequestFailed`."""
        while True:
            item = await self.queue.get()
            if isinstance(item, Failure):
                raise RequestFailed(item.message)
            yield item
            if item.finish is not None:
                return


class PendingRequests:
    def __init__(self) -> None:
        self._by_rid: dict[str, PendingRequest] = {}

    def __len__(self) -> int:
        return len(self._by_rid)

    def add(self, spec: GenerationSpec) -> PendingRequest:
        if spec.rid in self._by_rid:
            raise InvalidRequest(f"rid {spec.rid!r} is already in use", "rid")
        pending = PendingRequest(spec)
        self._by_rid[spec.rid] = pending
        return pending

    def remove(self, rid: str) -> PendingRequest | None:
        return self._by_rid.pop(rid, None)

    def dispatch(self, batch: TextBatch) -> None:
        counts = from_wire(batch.num_new_tokens).tolist()  # [R]
        token_ids = from_wire(batch.new_token_ids).tolist()  # [sum(counts)]
        prompt_tokens = from_wire(batch.prompt_tokens).tolist()  # [R]
        verify = from_wire(batch.spec_verify_ct).tolist() if batch.spec_verify_ct is not None else None
        logprobs = batch.logprobs or [None] * len(batch.rids)
        start = 0
        for i, rid in enumerate(batch.rids):
            end = start + counts[i]
            pending = self._by_rid.get(rid)
            if pending is not None:
                ct = verify[i] if verify is not None else None
                delta = Delta(batch.text_deltas[i], token_ids[start:end], prompt_tokens[i], batch.finish[i], logprobs[i], ct)
                self._push(pending, delta)
            start = end

    def _push(self, pending: PendingRequest, delta: Delta) -> None:
        pending.queue.put_nowait(delta)
        if delta.finish is not None:
            pending.finished = True
            self.remove(pending.rid)

    def fail(self, select: Callable[[PendingRequest], bool], message: str) -> list[str]:
        """Fail every pending request `select` picks; returns their rids."""
        failed = [p for p in self._by_rid.values() if select(p)]
        for pending in failed:
            self.remove(pending.rid)
            pending.queue.put_nowait(Failure(message))
        return [p.rid for p in failed]

    def fail_owned_by(self, instance_id: str, message: str) -> list[str]:
        return self.fail(lambda p: instance_id in (p.scheduler_id, p.detokenizer_id), message)
