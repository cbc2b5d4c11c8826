"""Logprob arrays -> the OpenAI `logprobs` objects (completions and chat). Pure functions.

Completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}` where
`text_offset[i]` is the character offset, in the returned text (echoed prompt included), of the
character that holds token i's first byte. Chat: `content` items `{token, bytes, logprob,
top_logprobs: [{token, bytes, logprob}]}`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.tokenizer.logprobs_format import LogprobChunks
from services.tokenizer.text_model import TextModel

CHAT_NULL_LOGPROB = -9999.0  # OpenAI's chat schema has no null logprob; it uses this floor


@dataclass(frozen=True)
class Positions:
    """Token positions with their logprobs: None value = nothing predicts it; None top = null row."""

    ids: list[int]  # [n]
    values: list[float | None]  # [n]
    top: list[list[tuple[int, float]] | None]  # [n] rows of (token id, logprob)

    def __add__(self, other: Positions) -> Positions:
        return Positions(self.ids + other.ids, self.values + other.values, self.top + other.top)


def _positions(values: np.ndarray, ids: Sequence[int], top_v: np.ndarray, top_i: np.ndarray) -> Positions:
    """values f32 [n], top_v f32 [n, k], top_i i32 [n, k] (k may be 0); a negative top id is padding
    (a row of them only: a null row)."""
    n = min(len(values), len(ids))
    vals = [None if v != v else v for v in values[:n].tolist()]
    rows_i, rows_v = top_i[:n].tolist(), top_v[:n].tolist()
    top: list[list[tuple[int, float]] | None]
    if top_i[:n].size == 0 or top_i[:n].min() >= 0:  # no padding (the usual case): one zip per row
        top = [list(zip(row_i, row_v)) for row_i, row_v in zip(rows_i, rows_v)]
    else:
        top = []
        for row_v, row_i in zip(rows_v, rows_i, strict=True):
            null = bool(row_i) and all(i < 0 for i in row_i)
            top.append(None if null else [(i, v) for v, i in zip(row_v, row_i, strict=True) if i >= 0])
    top += [[] for _ in range(n - len(top))]
    return Positions(list(ids[:n]), vals, top)


def prompt_positions(chunks: LogprobChunks, prompt_ids: Sequence[int], k: int) -> Positions:
    rows = chunks.prompt_rows(k, 0)
    ids = list(prompt_ids[rows.start : rows.start + rows.num_rows])
    return _positions(rows.token, ids, rows.top_values, rows.top_ids)


def output_positions(chunks: LogprobChunks, output_ids: Sequence[int], k: int) -> Positions:
    rows = chunks.output_rows(k, 0)
    return _positions(rows.token, output_ids, rows.top_values, rows.top_ids)


def text_offsets(pieces: Sequence[bytes], start: int = 0) -> list[int]:
    """Character offset of each piece's first byte in the UTF-8 text the pieces join into,
    plus `start`. A piece starting inside a multi-byte character gets that character's offset;
    an empty piece, that of the next piece with bytes (the text's length if none follows).
    Plain Python: numpy's fixed cost (a join, frombuffer, cumsums) dominated the one piece of a
    streamed token."""
    offsets: list[int] = []
    waiting = 0  # empty pieces, offset by the next piece with bytes
    begun = 0  # characters begun in the pieces so far
    for piece in pieces:
        if not piece:
            waiting += 1
            continue
        inside = (piece[0] & 0xC0) == 0x80  # a continuation byte: the character began in an earlier piece
        offsets.extend([start + (max(begun - 1, 0) if inside else begun)] * (waiting + 1))
        waiting = 0
        begun += len(piece) if piece.isascii() else sum((b & 0xC0) != 0x80 for b in piece)
    offsets.extend([start + begun] * waiting)
    return offsets


def completion_logprobs(
    positions: Positions, model: TextModel, visible: Sequence[bytes], start_offset: int = 0
) -> dict[str, Any]:
    """`visible[i]`: the bytes token i contributes to the returned text (b"" when skipped)."""
    labels = model.token_labels
    return {
        "tokens": [labels[i] for i in positions.ids],
        "token_logprobs": positions.values,
        "top_logprobs": [None if row is None else {labels[i]: v for i, v in row} for row in positions.top],
        "text_offset": text_offsets(visible, start_offset),
    }


def visible_bytes(ids: Sequence[int], model: TextModel, skip_special_tokens: bool) -> list[bytes]:
    skipped = model.special_ids if skip_special_tokens else frozenset()
    return [b"" if i in skipped else model.token_bytes[i] for i in ids]


def chat_content(positions: Positions, model: TextModel) -> list[dict[str, Any]]:
    labels, byte_lists = model.token_labels, model.token_byte_lists  # `bytes`: one shared tuple per id, a JSON array
    items = []
    for token_id, value, row in zip(positions.ids, positions.values, positions.top, strict=True):
        value = CHAT_NULL_LOGPROB if value is None else value
        top = [{"token": labels[i], "bytes": byte_lists[i], "logprob": v} for i, v in row or []]
        items.append({"token": labels[token_id], "bytes": byte_lists[token_id], "logprob": value, "top_logprobs": top})
    return items
