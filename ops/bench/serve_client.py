"""One streamed request of `sparkwire bench serve`, timed as the client sees it.

Two endpoints: `/generate` (Sparkwire's and SGLang's native API; each SSE event carries the
cumulative `output_ids`, so the tokens of every event are known exactly) and `/v1/completions`
(any OpenAI-compatible server; an event's tokens are known only when logprobs are asked for —
otherwise each event counts as one token, as `vllm bench serve` counts them — and the totals come
from the final `usage` event, asked for with `stream_options.include_usage`).

The client is aiohttp on uvloop, as `vllm bench serve`'s is: a fraction of the CPU per event of
the httpx client it replaced, which saturated its core and so delayed every request it sent and
timed (the figures: ops/bench/results/serve.md).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from collections.abc import AsyncIterator
from typing import Any, NamedTuple, Protocol

import aiohttp
import msgspec

from ops.bench.serve_workload import Prompt

DONE = b"[DONE]"
ERROR_TEXT_CHARS = 300  # of a failed response's body, kept in the record
JSON = {"Content-Type": "application/json"}
_encode = msgspec.json.Encoder().encode


def client_session(api_key: str | None, timeout_s: float) -> aiohttp.ClientSession:
    """The one session a run sends every request through."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No connection cap: max_concurrency is the benchmark's to set, not the pool's. No proxies
    # from the environment (trust_env off): they would sit between the client and the server.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    return aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout, trust_env=False)


@dataclass(frozen=True)
class RequestOptions:
    """What every request of one run asks for, besides its prompt and length."""

    ignore_eos: bool = False
    temperature: float = 0.0
    logprobs: int | None = None  # top-k logprobs per output token; None: no logprobs
    prompt_logprobs: bool = False  # /generate only: the same top-k for every prompt position too
    model_name: str | None = None  # OpenAI `model`


class EventFigures(NamedTuple):
    """What one SSE event says; None where it says nothing."""

    new_tokens: int
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # the request's total so far
    error: str | None = None


class Endpoint(Protocol):
    path: str

    def body(self, prompt: Prompt, options: RequestOptions) -> dict[str, Any]: ...

    def read(self, event: dict[str, Any], tokens_so_far: int) -> EventFigures: ...


class NativeEndpoint:
    path = "/generate"

    def body(self, prompt: Prompt, options: RequestOptions) -> dict[str, Any]:
        sampling = {"max_new_tokens": prompt.output_len, "temperature": options.temperature, "ignore_eos": options.ignore_eos}
        body: dict[str, Any] = {"sampling_params": sampling, "stream": True}
        body.update({"input_ids": list(prompt.input_ids)} if prompt.input_ids is not None else {"text": prompt.text})
        if options.logprobs is not None:
            body.update(return_logprob=True, top_logprobs_num=options.logprobs)
        if options.prompt_logprobs:
            body["logprob_start_len"] = 0
        return body

    def read(self, event: dict[str, Any], tokens_so_far: int) -> EventFigures:
        if "error" in event:
            return EventFigures(0, error=str(event["error"].get("message", event["error"])))
        total, meta = len(event.get("output_ids") or ()), event.get("meta_info") or {}
        return EventFigures(total - tokens_so_far, meta.get("prompt_tokens"), total)


class CompletionsEndpoint:
    path = "/v1/completions"

    def body(self, prompt: Prompt, options: RequestOptions) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(prompt.input_ids) if prompt.input_ids is not None else prompt.text,
            "max_tokens": prompt.output_len,
            "temperature": options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if options.ignore_eos:
            body["ignore_eos"] = True  # vLLM/SGLang extension; sent only when asked, for strict servers
        if options.logprobs is not None:
            body["logprobs"] = options.logprobs
        if options.model_name is not None:
            body["model"] = options.model_name
        return body

    def read(self, event: dict[str, Any], tokens_so_far: int) -> EventFigures:
        if "error" in event:
            return EventFigures(0, error=str(event["error"].get("message", event["error"])))
        usage = event.get("usage") or {}
        new_tokens = sum(_choice_tokens(choice) for choice in event.get("choices") or ())
        return EventFigures(new_tokens, usage.get("prompt_tokens"), usage.get("completion_tokens"))


def _choice_tokens(choice: dict[str, Any]) -> int:
    logprobs = choice.get("logprobs")
    return len(logprobs["tokens"]) if logprobs and logprobs.get("tokens") is not None else 1


ENDPOINTS: dict[str, Endpoint] = {"generate": NativeEndpoint(), "completions": CompletionsEndpoint()}


@dataclass
class RequestRecord:
    """One request; times in seconds from the moment it was sent."""

    prompt: Prompt
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # each token-carrying event's arrival
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in that event
    prompt_tokens: int = 0
    output_tokens: int = 0
    sent_at: float = 0.0  # time.monotonic() as it was sent: a step trace's clock

    @property
    def ok(self) -> bool:
        return not self.error

    def add(self, figures: EventFigures, at: float) -> None:
        if figures.error is not None:
            self.error = figures.error
        if figures.prompt_tokens is not None:
            self.prompt_tokens = figures.prompt_tokens
        if figures.new_tokens > 0:
            self.ttft = self.ttft or at
            self.chunk_times.append(at)
            self.chunk_tokens.append(figures.new_tokens)
        self.output_tokens = figures.output_tokens if figures.output_tokens is not None else sum(self.chunk_tokens)


async def send(
    client: aiohttp.ClientSession, base_url: str, endpoint: Endpoint, prompt: Prompt, options: RequestOptions
) -> RequestRecord:
    """Stream one request to `base_url` + the endpoint's path (a base URL may have a path of its
    own); a failure of any kind is kept in the record, never raised."""
    record = RequestRecord(prompt, prompt_tokens=len(prompt.input_ids or ()), sent_at=time.monotonic())
    start = time.perf_counter()
    try:
        url, body = base_url.rstrip("/") + endpoint.path, _encode(endpoint.body(prompt, options))
        async with client.post(url, data=body, headers=JSON) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.read())[:ERROR_TEXT_CHARS]!r}"
            else:
                await _read_stream(response, endpoint, record, start)
    except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.e2e = time.perf_counter() - start
    if record.ok and not record.chunk_times:
        record.error = "the stream ended without a token"
    return record


async def _read_stream(response: aiohttp.ClientResponse, endpoint: Endpoint, record: RequestRecord, start: float) -> None:
    async for line in sse_lines(response.content):
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, other SSE fields
        data = line[5:].strip()
        if data == DONE:
            return
        record.add(endpoint.read(msgspec.json.decode(data), record.output_tokens), time.perf_counter() - start)
        if not record.ok:
            return


async def sse_lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body's lines as they arrive, of any length: aiohttp's own line reader refuses a line
    over its buffer (64 KiB), and an event of prompt logprobs for a long prompt is megabytes."""
    parts: list[bytes] = []  # the line under way, in the pieces it came in
    async for chunk in content.iter_any():
        if b"\n" not in chunk:
            parts.append(chunk)
            continue
        first, *lines, last = chunk.split(b"\n")
        yield b"".join([*parts, first])
        for line in lines:
            yield line
        parts = [last]
    if rest := b"".join(parts):
        yield rest
