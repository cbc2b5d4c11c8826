"""A step's output logprob entries as `OutputLogprobColumns`: one array per kind for a whole
`TokenBatch`, not three `NDArray`s and a `RequestLogprobs` per request, built and read in one place.

The scheduler builds them (`to_columns`, from each request's numpy arrays) where it used to wrap
every request's arrays for the wire (~4 us a request a step on its host, the same process and
GIL as the device's step loop); the detokenizer reads them back into the per-request fields of
`RequestLogprobs` (`per_request`), so what it sends on (`TextBatch`) is what it was.

Layout, over the batch's R requests: request i owns `rows[i]` rows (its new tokens when it asked
for logprobs, else 0), in request order, of `token_logprobs`; `rows[i] * top_k[i]` values of
`top_logprobs` / `top_ids` (row-major [rows, k]); `rows[i] * num_ids[i]` of `ids_logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from contracts.arrays import NDArray
from contracts.detokenizer import OutputLogprobColumns
from services.common.arrays import from_wire, to_wire


class OutputEntries(Protocol):
    """What `to_columns` reads of a request's entries (`services.scheduler.request.LogprobEntries`)."""

    output_token_logprobs: np.ndarray | None  # f32 [n]
    output_top_logprobs: np.ndarray | None  # f32 [n, k]
    output_top_ids: np.ndarray | None  # i32 [n, k]
    output_ids_logprobs: np.ndarray | None  # f32 [n, m]


def to_columns(entries: Sequence[OutputEntries | None]) -> OutputLogprobColumns | None:
    """The output entries of every request of a batch (None: it asked for no logprobs) as columns;
    None when no request has output rows in this step. One pass over the requests (this runs on
    the scheduler's host, per step)."""
    rows, top_k, num_ids = [], [], []
    tokens, top_values, top_ids, ids = [], [], [], []
    for e in entries:
        token = None if e is None else e.output_token_logprobs
        top = None if token is None else e.output_top_logprobs
        requested = None if token is None else e.output_ids_logprobs
        rows.append(0 if token is None else len(token))
        top_k.append(0 if top is None else top.shape[1])
        num_ids.append(0 if requested is None else requested.shape[1])
        if token is not None:
            tokens.append(token)
        if top is not None:
            top_values.append(top)
            top_ids.append(e.output_top_ids)
        if requested is not None:
            ids.append(requested)
    if not tokens:
        return None
    columns = {"rows": to_wire(np.asarray(rows, np.int32)), "token_logprobs": _flat(tokens, np.float32)}
    if top_values:
        columns |= {"top_k": to_wire(np.asarray(top_k, np.int32)), "top_logprobs": _flat(top_values, np.float32),
                    "top_ids": _flat(top_ids, np.int32)}  # fmt: skip
    if ids:
        columns |= {"num_ids": to_wire(np.asarray(num_ids, np.int32)), "ids_logprobs": _flat(ids, np.float32)}
    return OutputLogprobColumns(**columns)


def _flat(arrays: list[np.ndarray], dtype) -> NDArray:
    """The arrays' values in order, as one vector: one concatenate when they share their width (the
    usual batch: one k for all)."""
    if arrays[0].ndim == 1 or len({a.shape[1] for a in arrays}) == 1:
        values = np.concatenate(arrays).reshape(-1)
    else:
        values = np.concatenate([a.reshape(-1) for a in arrays])
    return to_wire(values.astype(dtype, copy=False))


def per_request(columns: OutputLogprobColumns) -> list[dict[str, NDArray] | None]:
    """Per request: its `RequestLogprobs` output fields, or None when it has no output rows in this
    step. Each an `NDArray` over a slice of the column's bytes (no copy, no numpy per request: this
    runs per request per step in the detokenizer)."""
    rows = from_wire(columns.rows).tolist()
    top_k = _widths(columns.top_k, len(rows))
    num_ids = _widths(columns.num_ids, len(rows))
    token = memoryview(columns.token_logprobs.data).cast("B")
    top_values = memoryview(columns.top_logprobs.data).cast("B") if columns.top_logprobs is not None else None
    top_ids = memoryview(columns.top_ids.data).cast("B") if columns.top_ids is not None else None
    ids = memoryview(columns.ids_logprobs.data).cast("B") if columns.ids_logprobs is not None else None
    fields: list[dict[str, NDArray] | None] = []
    at = top_at = ids_at = 0  # in 4-byte entries
    for n, k, m in zip(rows, top_k, num_ids, strict=True):
        if n == 0:
            fields.append(None)
            continue
        entry = {"output_token_logprobs": NDArray("<f4", (n,), token[4 * at : 4 * (at + n)])}
        at += n
        if k:
            size = n * k
            entry["output_top_logprobs"] = NDArray("<f4", (n, k), top_values[4 * top_at : 4 * (top_at + size)])
            entry["output_top_ids"] = NDArray("<i4", (n, k), top_ids[4 * top_at : 4 * (top_at + size)])
            top_at += size
        if m:
            entry["output_ids_logprobs"] = NDArray("<f4", (n, m), ids[4 * ids_at : 4 * (ids_at + n * m)])
            ids_at += n * m
        fields.append(entry)
    return fields


def _widths(column: NDArray | None, count: int) -> list[int]:
    return from_wire(column).tolist() if column is not None else [0] * count
