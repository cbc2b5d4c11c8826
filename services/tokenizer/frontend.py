"""What every HTTP handler shares: the `Frontend` (service, model, config, metrics), waiting for
requests while watching for the client to leave, and aborting what a departed client left."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import structlog
from litestar import Request

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.metrics import Metrics
from services.tokenizer.native import SSE_DONE, GenerationResult, collect, error_body, sse
from services.tokenizer.requests import Delta, PendingRequest, RequestFailed
from services.tokenizer.service import TokenizerService
from services.tokenizer.structured import asks_for_grammar
from services.tokenizer.text_model import TextModel
from services.tokenizer.validation import GenerationSpec

log = structlog.get_logger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Bodies from this size on are validated and tokenized in a worker thread: tokenizing a few MB
# takes seconds. Smaller ones stay on the loop (microseconds), so they never queue behind them.
OFF_LOOP_MIN_BODY_BYTES = 64 * 1024
NUM_TOKENIZE_WORKERS = 2

R = TypeVar("R")


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
    workers: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(NUM_TOKENIZE_WORKERS, thread_name_prefix="tokenize")
    )

    async def prepare(self, request: Request, work: Callable[..., R], body: msgspec.Struct, *args: Any) -> R:
        """Run `work(body, *args)` (validation and tokenization: plain CPU work), in a worker thread
        when the body is large or brings a grammar (xgrammar parses it, and the process's first
        grammar imports xgrammar: seconds), so no request stalls the others."""
        small = int(request.headers.get("content-length") or 0) < OFF_LOOP_MIN_BODY_BYTES
        if small and not asks_for_grammar(body):
            return work(body, *args)
        return await asyncio.get_running_loop().run_in_executor(self.workers, lambda: work(body, *args))

    async def submit_all(self, specs: list[GenerationSpec], n: int = 1) -> list[PendingRequest]:
        """Submit every spec (prompt-major: each run of `n` is one prompt's choices, submitted
        together so one scheduler computes the prompt once); on a failure abort those already
        submitted and re-raise."""
        submitted: list[PendingRequest] = []
        try:
            for start in range(0, len(specs), n):
                submitted.extend(await self.service.submit_choices(specs[start : start + n]))
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



def request_left(metrics: Metrics, pending: PendingRequest) -> None:
    """Every request, once, when it leaves: metrics and the one-line summary (vLLM prints
    something similar per request; here it is the line to grep a request id for)."""
    metrics.observe_request(pending)
    timing = pending.timing
    log.info(
        "request.finished", request_id=pending.spec.request_id, rid=pending.rid, outcome=pending.outcome,
        prompt_tokens=pending.prompt_tokens, completion_tokens=timing.num_output_tokens,
        ttft_s=_rounded(timing.first_token_at, timing.arrived_at), e2e_s=round(timing.e2e_s(), 4),
        scheduler=pending.scheduler_id, detokenizer=pending.detokenizer_id,
    )  # fmt: skip


def _rounded(at: float | None, since: float) -> float | None:
    return None if at is None else round(at - since, 4)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream_then_abort(
    frontend: Frontend, pendings: list[PendingRequest], events: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """Wrap an SSE generator: if the client leaves mid-stream, abort the request. A bug while
    streaming (the status line is long sent) becomes a logged error event, then [DONE]."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        log.error("http.stream_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        yield sse(error_body("internal server error while streaming", "internal_error", 500))
        yield SSE_DONE
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
