"""Record golden message streams from a running stack, for the replay tests in tests/replay.

`record_golden` records the `sparkwire.v2` messages on `subject` while it sends HTTP requests to
the stack's tokenizer one at a time, and returns the HTTP responses. Commit the recording and the
responses; the replay tests publish the recorded scheduler output into fresh detokenizer and
tokenizer services and compare their answers with these responses (after `normalise`, which
blanks what differs from run to run, and, for streams, `fold_stream`: a tokenizer merges the
steps a reader has not taken yet into one event, so how tokens group into events depends on
timing). Standard library HTTP only, so a production install needs nothing extra.
`ops/record/record_goldens.py` (re)records the committed goldens.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts import subjects
from services.recorder.record import RecordStats, record


@dataclass(frozen=True)
class GoldenCase:
    path: str  # e.g. "/generate", "/v1/completions"
    body: dict[str, Any]


@dataclass(frozen=True)
class GoldenResponse:
    status: int
    body: str  # raw: JSON, or SSE events for stream=true


async def record_golden(
    nats_url: str,
    http_url: str,
    cases: list[GoldenCase],
    out: Path | str,
    settle_s: float = 0.5,
    timeout_s: float = 120.0,
    subject: str = subjects.ALL,
) -> tuple[list[GoldenResponse], RecordStats]:
    """`settle_s` after the last response lets trailing messages (aborts, heartbeats) land."""
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(record(nats_url, out, subject, stop=stop, ready=ready))
    await asyncio.wait_for(ready.wait(), timeout_s)
    try:
        responses = [await asyncio.to_thread(post_json, http_url + case.path, case.body, timeout_s) for case in cases]
        await asyncio.sleep(settle_s)
    finally:
        stop.set()
    return responses, await task


def post_json(url: str, body: dict[str, Any], timeout_s: float) -> GoldenResponse:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return GoldenResponse(response.status, response.read().decode())
    except urllib.error.HTTPError as error:
        return GoldenResponse(error.code, error.read().decode())


# Values that differ between two runs of the same request: timings, OpenAI call ids, timestamps.
VOLATILE_KEYS = frozenset({"e2e_latency", "created"})
OPENAI_ID_PREFIXES = ("cmpl-", "chatcmpl-")


def parse_body(response: GoldenResponse) -> Any:
    """A JSON body as JSON; an SSE body as its list of events (JSON, or the `[DONE]` string)."""
    if not response.body.startswith("data: "):
        return json.loads(response.body)
    events = [block.removeprefix("data: ") for block in response.body.split("\n\n") if block.strip()]
    return [event if event == "[DONE]" else json.loads(event) for event in events]


def normalise(value: Any) -> Any:
    """`value` with volatile fields blanked, so a replayed response can equal its golden."""
    if isinstance(value, list):
        return [normalise(item) for item in value]
    if not isinstance(value, dict):
        return value
    return {key: _normalise_field(key, item) for key, item in value.items()}


def _normalise_field(key: str, value: Any) -> Any:
    if key in VOLATILE_KEYS:
        return "<volatile>"
    if key == "id" and isinstance(value, str) and value.startswith(OPENAI_ID_PREFIXES):
        return value.split("-", 1)[0] + "-<id>"
    return normalise(value)


# /generate's per-event logprob lists: each event carries only its new entries (PRODUCT §3)
NATIVE_INCREMENTAL = frozenset({"input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                                "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs"})  # fmt: skip


def fold_stream(events: list[Any]) -> list[Any]:
    """A streamed body's consecutive data events of one choice merged, as a client reading the
    stream sees them: two streams that carry the same tokens fold alike however they were grouped
    into events. /generate: cumulative fields from the later event, logprob lists joined; OpenAI
    chunks: text (or the chat delta's content) and logprob lists joined, the later finish_reason.
    `[DONE]`, errors, role-only chat chunks and usage chunks stay events of their own."""
    folded: list[Any] = []
    for event in events:
        merged = _folded_pair(folded[-1], event) if folded else None
        if merged is None:
            folded.append(event)
        else:
            folded[-1] = merged
    return folded


def _folded_pair(first: Any, then: Any) -> dict[str, Any] | None:
    if not (isinstance(first, dict) and isinstance(then, dict)) or "error" in first or "error" in then:
        return None
    if "meta_info" in first and "meta_info" in then:
        meta = dict(first["meta_info"])
        for key, value in then["meta_info"].items():
            meta[key] = meta.get(key, []) + value if key in NATIVE_INCREMENTAL else value
        return {**then, "meta_info": meta}
    return _folded_choice(first, then)


def _folded_choice(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any] | None:
    choices = first.get("choices"), then.get("choices")
    if not all(isinstance(c, list) and len(c) == 1 for c in choices) or choices[0][0]["index"] != choices[1][0]["index"]:
        return None
    a, b = choices[0][0], choices[1][0]
    if "delta" in a:
        if "role" in a["delta"] or "role" in b["delta"]:
            return None
        merged = {**b, "delta": {**b["delta"], "content": a["delta"].get("content", "") + b["delta"].get("content", "")}}
    else:
        merged = {**b, "text": a["text"] + b["text"]}
    merged["logprobs"] = _joined_lists(a.get("logprobs"), b.get("logprobs"))
    return {**then, "choices": [merged]}


def _joined_lists(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two events' logprobs objects with each list field joined (completions: tokens, token_logprobs,
    top_logprobs, text_offset; chat: content)."""
    if a is None or b is None:
        return b if a is None else a
    return {key: a.get(key, []) + value if isinstance(value, list) else value for key, value in b.items()}
