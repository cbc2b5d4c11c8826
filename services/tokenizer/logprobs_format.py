"""Logprob arrays from the scheduler -> the JSON fields of the native /generate API.

Pure functions over numpy arrays (no NATS, no HTTP). Conventions of
`contracts.logprobs.LogprobColumns`: NaN is a null value, a row of -1 ids is a null row.
A triple is `[logprob | None, token_id, text | None]`; text only with `return_text_in_logprobs`.
Each field is built once from the request's complete arrays (non-stream), or once per SSE event
from that event's new entries (stream).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from services.common.flat_logprobs import FlatLogprobsError, build_flat_top_logprobs
from services.common.logprob_rows import RequestLogprobs, RowLogprobs
from services.tokenizer.json_body import Base64Field

log = structlog.get_logger(__name__)

Triple = list[Any] | tuple[Any, ...]  # [logprob | None, token_id, text | None]
TextOf = Callable[[int], str] | None


@dataclass(frozen=True)
class FormatOptions:
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None  # None: not requested
    text_of: TextOf = None  # token id -> text, only with return_text_in_logprobs
    flat: bool = False
    flat_b64: bool = False
    stream_event: bool = False  # one SSE event's entries: flat fields only in the event that carries rows


@dataclass
class LogprobChunks:
    """One request's logprob rows gathered over one or more steps (numpy views, joined when formatted)."""

    output: list[RowLogprobs] = field(default_factory=list)
    prompt: list[RowLogprobs] = field(default_factory=list)
    flat: RowLogprobs | None = None  # as the scheduler sent it (PRODUCT §5): the top-k rows, `start` the null prefix

    def add(self, lp: RequestLogprobs) -> None:
        if lp.output is not None:
            self.output.append(lp.output)
        if lp.prompt is not None:
            self.prompt.append(lp.prompt)
        if lp.flat is not None:
            self.flat = lp.flat

    def add_all(self, entries: tuple[RequestLogprobs, ...]) -> None:
        for lp in entries:
            self.add(lp)

    @property
    def num_input(self) -> int:
        return sum(rows.num_rows for rows in self.prompt)

    def prompt_rows(self, k: int, m: int) -> RowLogprobs:
        return _joined(self.prompt, k, m)

    def output_rows(self, k: int, m: int) -> RowLogprobs:
        return _joined(self.output, k, m)


def _joined(parts: list[RowLogprobs], k: int, m: int) -> RowLogprobs:
    """The parts as one (the part itself when there is one: a streamed step's; read only); empty
    rows of widths k and m when there are none."""
    if parts:
        return RowLogprobs.joined(parts)
    return RowLogprobs(np.empty(0, "<f4"), np.empty((0, k), "<f4"), np.empty((0, k), "<i4"), np.empty((0, m), "<f4"))


FEW_ROWS = 8  # token_triples: rows up to this many skip numpy's NaN search


def token_triples(values: np.ndarray, ids: Sequence[int], text_of: TextOf) -> list[Triple]:
    """values f32 [n], ids [n] -> n triples. Hot for long prompts (32k-128k positions): no
    per-entry function call; the few NaNs (null positions) are patched afterwards."""
    logprobs: list[float | None] = values.tolist()
    if len(logprobs) <= FEW_ROWS:  # a streamed event's one token: numpy's fixed cost would be most of it
        logprobs = [None if v != v else v for v in logprobs]
    else:
        for index in np.flatnonzero(np.isnan(values)).tolist():
            logprobs[index] = None
    # Tuples, not lists: JSON-encoded the same, but cheaper to build (lists are tracked by the
    # cyclic GC, whose collections dominate building 100k+ small lists).
    texts = [text_of(i) for i in ids] if text_of else itertools.repeat(None)
    return list(zip(logprobs, ids, texts))


def top_rows(values: np.ndarray, ids: np.ndarray, text_of: TextOf) -> list[list[Triple] | None]:
    """values f32 [n, k], ids i32 [n, k] -> per position null (a -1 row) or k triples."""
    rows: list[list[Triple] | None] = []
    for vrow, irow in zip(values.tolist(), ids.tolist(), strict=True):
        if all(i < 0 for i in irow):
            rows.append(None)
            continue
        # tuples and no call per entry (NaN -> null inline), as `token_triples`: JSON-encoded the same
        rows.append([(None if v != v else v, i, text_of(i) if text_of else None) for v, i in zip(vrow, irow, strict=True) if i >= 0])
    return rows


def ids_rows(values: np.ndarray, token_ids: tuple[int, ...], text_of: TextOf) -> list[list[Triple] | None]:
    """values f32 [n, m] for the requested ids -> per position null (an all-NaN row) or m triples."""
    rows: list[list[Triple] | None] = []
    for vrow in values.tolist():
        if vrow and all(v != v for v in vrow):
            rows.append(None)
            continue
        rows.append([(None if v != v else v, i, text_of(i) if text_of else None) for v, i in zip(vrow, token_ids, strict=True)])
    return rows


def flat_fields(flat: RowLogprobs, b64: bool) -> dict[str, Any]:
    """PRODUCT §5 fields that replace `input_top_logprobs`; b64 bytes are little-endian."""
    values = np.ascontiguousarray(flat.top_values, dtype="<f4")  # [rows, k]
    ids = np.ascontiguousarray(flat.top_ids, dtype="<i4")  # [rows, k]
    fields: dict[str, Any] = {
        "input_top_logprobs_shape": list(values.shape),
        "input_top_logprobs_null_prefix": flat.start,
    }
    if b64:
        # The arrays themselves: `json_body.encode_json` writes their base64 straight into the body.
        fields["input_top_logprobs_val_flat_b64"] = Base64Field(values)
        fields["input_top_logprobs_idx_flat_b64"] = Base64Field(ids)
        fields["input_top_logprobs_val_flat_b64_dtype"] = "float32"
        fields["input_top_logprobs_idx_flat_b64_dtype"] = "int32"
    else:
        fields["input_top_logprobs_val_flat"] = values.ravel().tolist()
        fields["input_top_logprobs_idx_flat"] = ids.ravel().tolist()
    return fields


def _input_top(chunks: LogprobChunks, rows: RowLogprobs, opts: FormatOptions) -> dict[str, Any]:
    """Nested rows, or the flat fields: the scheduler's arrays win over anything rebuilt here,
    whenever they arrive; nested rows are converted only when no arrays came."""
    k = opts.top_logprobs_num
    values, ids = rows.top_values, rows.top_ids  # [p, k] each
    if not opts.flat:
        return {"input_top_logprobs": top_rows(values, ids, opts.text_of)}
    if chunks.flat is not None:
        return flat_fields(chunks.flat, opts.flat_b64)
    if opts.stream_event and rows.num_rows == 0:
        return {}  # a client that overwrites fields per event must not read an empty [0, k] over the arrays
    try:
        return flat_fields(build_flat_top_logprobs(values, ids, k), opts.flat_b64)
    except FlatLogprobsError as exc:
        log.warning("logprobs.flat_fallback_to_nested", error=str(exc))
        return {"input_top_logprobs": top_rows(values, ids, opts.text_of)}


def _widths(opts: FormatOptions) -> tuple[int, int]:
    return opts.top_logprobs_num, len(opts.token_ids_logprob or ())


def _input_fields(chunks: LogprobChunks, prompt_ids: Sequence[int], opts: FormatOptions) -> dict[str, Any]:
    rows = chunks.prompt_rows(*_widths(opts))
    ids = list(prompt_ids[rows.start : rows.start + rows.num_rows])
    fields: dict[str, Any] = {"input_token_logprobs": token_triples(rows.token, ids, opts.text_of)}
    if opts.top_logprobs_num > 0:
        fields.update(_input_top(chunks, rows, opts))
    if opts.token_ids_logprob is not None:
        fields["input_token_ids_logprobs"] = ids_rows(rows.ids, opts.token_ids_logprob, opts.text_of)  # [p, m]
    return fields


def _output_fields(chunks: LogprobChunks, output_ids: Sequence[int], opts: FormatOptions) -> dict[str, Any]:
    rows = chunks.output_rows(*_widths(opts))
    fields: dict[str, Any] = {"output_token_logprobs": token_triples(rows.token, output_ids, opts.text_of)}
    if opts.top_logprobs_num > 0:
        fields["output_top_logprobs"] = top_rows(rows.top_values, rows.top_ids, opts.text_of)
    if opts.token_ids_logprob is not None:
        fields["output_token_ids_logprobs"] = ids_rows(rows.ids, opts.token_ids_logprob, opts.text_of)  # [n, m]
    return fields


def meta_logprobs(
    chunks: LogprobChunks, prompt_ids: Sequence[int], output_ids: Sequence[int], opts: FormatOptions
) -> dict[str, Any]:
    """The `meta_info` logprob fields for the entries in `chunks`; `output_ids` are the output
    tokens those entries cover (all of them, or one SSE event's new ones)."""
    return {**_input_fields(chunks, prompt_ids, opts), **_output_fields(chunks, output_ids, opts)}
