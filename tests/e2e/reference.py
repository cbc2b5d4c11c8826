"""What the stack's logprobs must equal, computed in the test process, plus small HTTP helpers.

The reference is one plain forward pass of the real model runtime over the final sequence (prompt
ids + output ids), on CPU in fp32 with the same seeded weights the scheduler process loads. Token
texts and bytes come from `tokenizer.json` directly (not from the tokenizer service's tables).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jinja2.sandbox
import torch
from tokenizers import Tokenizer

from services.scheduler.config import BUNDLED_MODEL
from plain_forward import reference_logprobs  # noqa: F401  (re-exported for the e2e tests)
from services.scheduler.model import ModelRunner, load_model_runner

TOL = 1e-4  # PRODUCT §4: fp32 logprobs within 1e-4 of a plain forward pass
KV_BLOCKS = 64  # 1024 token slots: more than any test sequence here


def load_reference_runner(model_dir: Path = BUNDLED_MODEL) -> ModelRunner:
    """The scheduler's own defaults (seed 0): the same deterministic weights as the service."""
    return load_model_runner(model_dir, device="cpu", dtype=torch.float32, num_kv_blocks=KV_BLOCKS, kv_block_size=16, seed=0)


def check_top(row: torch.Tensor, entries: list[tuple[float, int]], k: int) -> None:
    """`entries` ((logprob, id), in the returned order) are the k best of reference `row` [V]:
    each value equals the reference, sorted by logprob then id, none beaten by a left-out id."""
    assert len(entries) == k, entries
    ids = [i for _, i in entries]
    assert len(set(ids)) == k, f"duplicate ids in a top-k row: {ids}"
    for value, token_id in entries:
        assert abs(value - row[token_id].item()) <= TOL, (token_id, value, row[token_id].item())
    for (v1, i1), (v2, i2) in zip(entries, entries[1:]):
        assert v1 > v2 or (v1 == v2 and i1 < i2), f"top-k row not sorted by (logprob desc, id asc): {entries}"
    kth_best = torch.topk(row, k).values[-1].item()
    assert entries[-1][0] >= kth_best - TOL, f"row misses a better id: last {entries[-1]} vs k-th best {kth_best}"


@dataclass(frozen=True)
class LogprobRequest:
    """What one /generate request asked for, to check its response against the reference."""

    start: int  # logprob_start_len as sent (-1: output only)
    top: int = 0
    token_ids: tuple[int, ...] | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"return_logprob": True, "logprob_start_len": self.start, "top_logprobs_num": self.top}
        if self.token_ids is not None:
            body["token_ids_logprob"] = list(self.token_ids)
        return body


def check_counts(meta: dict[str, Any], request: LogprobRequest, num_output: int) -> None:
    """PRODUCT §4 length rules for one full response (or the concatenation of a stream's events)."""
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == num_output
    if request.start >= 0:
        assert meta["prompt_tokens"] == request.start + len(meta["input_token_logprobs"])
    else:
        assert meta["input_token_logprobs"] == []
    for name in ("input_top_logprobs", "output_top_logprobs") if request.top else ():
        base = "input_token_logprobs" if name.startswith("input") else "output_token_logprobs"
        assert len(meta[name]) == len(meta[base]), name
    for name in ("input_token_ids_logprobs", "output_token_ids_logprobs") if request.token_ids is not None else ():
        base = "input_token_logprobs" if name.startswith("input") else "output_token_logprobs"
        assert len(meta[name]) == len(meta[base]), name


def check_against_reference(
    ref: torch.Tensor, prompt: list[int], output: list[int], meta: dict[str, Any], request: LogprobRequest
) -> None:
    """Every value in `meta` equals reference `ref` f32 [len(prompt + output), V]; position p's
    token logprob is row p - 1. The first returned prompt position is null with its real token id
    (PRODUCT §4; as SGLang, also when logprob_start_len > 0)."""
    start = max(request.start, 0)
    positions = [*range(start, len(prompt))] if request.start >= 0 else []
    sequence = prompt + output
    kinds = (("input", positions), ("output", [*range(len(prompt), len(sequence))]))
    for kind, where in kinds:
        for j, p in enumerate(where):
            check_position(ref, sequence, p, meta, kind, j, request)


def check_position(
    ref: torch.Tensor, sequence: list[int], p: int, meta: dict[str, Any], kind: str, j: int, request: LogprobRequest
) -> None:
    value, token_id, _ = meta[f"{kind}_token_logprobs"][j]
    assert token_id == sequence[p], (kind, j, token_id, sequence[p])
    top = meta.get(f"{kind}_top_logprobs")
    ids = meta.get(f"{kind}_token_ids_logprobs")
    if kind == "input" and j == 0:  # PRODUCT §4: the first returned prompt position is null
        assert value is None and (not request.top or top[j] is None)
        assert request.token_ids is None or ids[j] is None
        return
    row = ref[p - 1]  # [V]
    assert abs(value - row[token_id].item()) <= TOL, (kind, p, value, row[token_id].item())
    if request.top:
        check_top(row, [(v, i) for v, i, _ in top[j]], request.top)
    if request.token_ids is not None:
        assert [i for _, i, _ in ids[j]] == list(request.token_ids)
        for v, i, _ in ids[j]:
            assert abs(v - row[i].item()) <= TOL, (kind, p, i, v, row[i].item())


# ---- HTTP ----


def sse_payloads(lines: list[str]) -> list[Any]:
    """`data:` payloads of an SSE body, JSON-decoded; the final `[DONE]` kept as a string."""
    out = []
    for line in lines:
        if line.startswith("data:"):
            payload = line.removeprefix("data:").strip()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def post_generate(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_generate(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        events = sse_payloads(list(response.iter_lines()))
    assert events[-1] == "[DONE]", events[-3:]
    return events[:-1]


LIST_FIELDS = (
    "input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
    "input_token_ids_logprobs", "output_token_ids_logprobs",
)


def merge_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's events folded into one response: cumulative fields from the last event, the
    per-event logprob lists concatenated."""
    last = events[-1]
    meta = dict(last["meta_info"])
    for name in LIST_FIELDS:
        if name in meta:
            meta[name] = [entry for event in events for entry in event["meta_info"].get(name, [])]
    return {"text": last["text"], "output_ids": last["output_ids"], "meta_info": meta}


# ---- token texts, straight from tokenizer.json ----


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> raw byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins = list(printable)
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            stand_ins.append(256 + len(stand_ins) - 188)  # 188 printable bytes keep their own character
    return {chr(c): b for b, c in zip(printable, stand_ins, strict=True)}


def _token_bytes_table(tokenizer: Tokenizer) -> tuple[bytes, ...]:
    added = {i: t.content.encode() for i, t in tokenizer.get_added_tokens_decoder().items()}
    decoder = _byte_decoder()
    pieces = (tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size()))
    return tuple(added.get(i) or bytes(decoder[c] for c in piece) for i, piece in enumerate(pieces))


@dataclass(frozen=True)
class Vocab:
    tokenizer: Tokenizer
    chat_template: str
    table: tuple[bytes, ...]  # [vocab] each id's raw bytes (special tokens: their content)

    @classmethod
    def load(cls, model_dir: Path = BUNDLED_MODEL) -> Vocab:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        return cls(tokenizer, config["chat_template"], _token_bytes_table(tokenizer))

    def token_bytes(self, token_id: int) -> bytes:
        return self.table[token_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        text = env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True)
        return self.encode(text, add_special_tokens=False)
