"""What every HTTP handler shares: the `Frontend` (service, model, config, metrics), waiting for
requests while watching for the client to leave, and aborting what a departed client left."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from litestar import Request

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.metrics import Metrics
from services.tokenizer.native import GenerationResult, collect
from services.tokenizer.requests import Delta, PendingRequest, RequestFailed
from services.tokenizer.service import TokenizerService
from services.tokenizer.text_model import TextModel
from services.tokenizer.validation import GenerationSpec

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


@dataclass
class Frontend:
    """What every handler needs: the service, the model's text side, config and metrics."""

    config: TokenizerConfig
    model: TextModel
    service: TokenizerService
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))

    async def submit_all(self, specs: list[GenerationSpec]) -> list[PendingRequest]:
        """Submit every spec; on a failure abort those already submitted and re-raise."""
        submitted: list[PendingRequest] = []
        try:
            for spec in specs:
                submitted.append(await self.service.submit(spec))
        except BaseException:
            for pending in submitted:
                await self.service.abort(pending.rid)
            raise
        return submitted

    async def collect_all(self, pendings: list[PendingRequest], request: Request) -> list[GenerationResult]:
        """Wait for every request to finish; abort them all if the client goes away first."""
        work = asyncio.ensure_future(asyncio.gather(*(collect(p) for p in pendings)))
        gone = asyncio.ensure_future(_until_disconnect(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if work.done() and work.exception() is None:
            return work.result()
        for pending in pendings:
            await self.service.abort(pending.rid)
        if work.done():
            return work.result()  # raises the failure
        work.cancel()
        raise ClientGone()

    def observe(self, endpoint: str, results: list[GenerationResult]) -> None:
        for result in results:
            self.metrics.observe_generation(endpoint, result.e2e_latency, result.prompt_tokens, len(result.output_ids))


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream_then_abort(
    frontend: Frontend, pendings: list[PendingRequest], events: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """Wrap an SSE generator: if the client leaves mid-stream, abort the request."""
    try:
        async for event in events:
            yield event
    finally:
        for pending in pendings:
            if not pending.finished:
                await frontend.service.abort(pending.rid)


async def merged_deltas(pendings: list[PendingRequest]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from several requests in arrival order; raises `RequestFailed`."""
    queue: asyncio.Queue[tuple[int, Delta | RequestFailed | None]] = asyncio.Queue()

    async def pump(index: int, pending: PendingRequest) -> None:
        try:
            async for delta in pending.deltas():
                queue.put_nowait((index, delta))
        except RequestFailed as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(pendings)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, RequestFailed):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
