"""A step's `RequestOutput`s -> one columnar `TokenBatch` per detokenizer, its output logprob entries
as the batch's columns where several requests have some (`OutputLogprobColumns`)."""

from __future__ import annotations

import numpy as np

from contracts.arrays import NDArray
from contracts.detokenizer import OutputLogprobColumns, RequestLogprobs, TokenBatch
from services.common.arrays import to_wire
from services.common.output_logprob_columns import to_columns
from services.scheduler.request import HostRows, LogprobEntries, RequestOutput, RowSpan, are_all_rows

# Output entries go as the batch's columns (`OutputLogprobColumns`) once this many requests have
# some: for one request its own three arrays are cheaper than the columns' five (host_step_cost.py).
COLUMNS_FROM_REQUESTS = 2
NO_PROMPT_ENTRIES = RequestLogprobs()  # a request that asked, with nothing new in this step (immutable, shared)


def to_request_logprobs(entries: LogprobEntries) -> RequestLogprobs:
    """The fields of the same names: arrays as NDArrays (views, no copy), unset ones left at None."""
    fields = {name: to_wire(value) if isinstance(value, np.ndarray) else value for name, value in entries.fields().items()}
    return RequestLogprobs(**fields)


def _beside_columns(entries: LogprobEntries) -> RequestLogprobs | None:
    """What a request's `logprobs` entry keeps where its output rows travel in the batch's columns:
    its prompt entries; None when it has none (the columns are all of it); an empty entry when it
    has neither (it asked, and nothing is new this step)."""
    if entries.has_prompt_entries():
        return to_request_logprobs(entries.prompt_part())
    return None if entries.output is not None else NO_PROMPT_ENTRIES


def to_token_batches(outputs: list[RequestOutput], scheduler_id: str, step: int) -> dict[str, TokenBatch]:
    """Group by detokenizer id, keeping each request's order within its group."""
    groups: dict[str, list[RequestOutput]] = {}
    for output in outputs:
        groups.setdefault(output.detokenizer_id, []).append(output)
    return {detokenizer_id: _token_batch(group, scheduler_id, step) for detokenizer_id, group in groups.items()}


def _token_batch(outputs: list[RequestOutput], scheduler_id: str, step: int) -> TokenBatch:
    new_ids = [token for output in outputs for token in output.new_token_ids]
    entries = [output.logprobs for output in outputs]
    logprobs, columns = None, None
    rows = [None if e is None else e.output for e in entries]  # each request's output rows (None: none)
    if len(rows) - rows.count(None) >= COLUMNS_FROM_REQUESTS:
        columns = _source_columns(rows) or to_columns(entries)
        # (the commonest entry, output rows alone, is None without a call to `_beside_columns`)
        beside = [None if e is None or (e.output is not None and not e.has_prompt_entries()) else _beside_columns(e) for e in entries]
        logprobs = beside if beside.count(None) < len(beside) else None
    elif entries.count(None) < len(entries):
        logprobs = [None if e is None else to_request_logprobs(e) for e in entries]
    return TokenBatch(
        scheduler_id=scheduler_id,
        step=step,
        rids=[output.rid for output in outputs],
        num_new_tokens=to_wire(np.asarray([len(o.new_token_ids) for o in outputs], np.int32)),  # [R]
        new_token_ids=to_wire(np.asarray(new_ids, np.int32)),  # [sum(num_new_tokens)]
        prompt_tokens=to_wire(np.asarray([o.prompt_tokens for o in outputs], np.int32)),  # [R]
        finish=[output.finish for output in outputs],
        logprobs=logprobs,
        spec_verify_ct=_verify_counts(outputs),
        output_logprobs=columns,
    )


def _source_columns(rows: list[HostRows | None]) -> OutputLogprobColumns | None:
    """The batch's output columns cut from the one step's columns its requests' rows are spans of
    (`RowSpan`: each asked for their widths): those columns as they are when the batch holds all
    of their rows in order (one detokenizer, a decode step), else one gather of their rows, instead
    of `to_columns` joining one array per request. None: some request's rows are rows of their own
    (`to_columns` takes them), or spans of another step's columns. rows: each request's (None: it
    has none), in the batch's order."""
    spans = [r for r in rows if r is not None]
    source = spans[0].source if spans[0].__class__ is RowSpan else None
    if source is None or not all(r.__class__ is RowSpan and r.source is source for r in spans):
        return None
    counts = [0 if r is None else r.count for r in rows]
    firsts = [r.start for r in spans if r.count]
    rows_of = np.asarray(counts, np.int32)  # [R]
    index = _source_rows(firsts, counts, len(source.token))

    def pick(column: np.ndarray) -> np.ndarray:
        return column if index is None else column[index]

    columns = {"rows": to_wire(rows_of), "token_logprobs": to_wire(pick(source.token))}
    k, m = source.top_values.shape[1], source.ids.shape[1]
    if k or m:
        has_rows = np.minimum(rows_of, 1)  # i32 [R]: 1 where a request has rows (its widths are the source's), else 0
    if k:
        columns |= {"top_k": to_wire(has_rows * k), "top_logprobs": to_wire(pick(source.top_values).reshape(-1)),
                    "top_ids": to_wire(pick(source.top_ids).reshape(-1))}  # fmt: skip
    if m:
        columns |= {"num_ids": to_wire(has_rows * m), "ids_logprobs": to_wire(pick(source.ids).reshape(-1))}
    return OutputLogprobColumns(**columns)


def _source_rows(firsts: list[int], counts: list[int], num_source: int) -> np.ndarray | None:
    """The source's rows of requests' runs (first rows of the runs, and every request's count, 0
    for those without rows), in order; None when they are all of its rows in order (nothing to
    gather: a decode step's one row per request, one detokenizer)."""
    if len(firsts) == sum(counts):  # one row a run (a decode step)
        if len(firsts) == num_source and (not firsts or (firsts[-1] == num_source - 1 and firsts == list(range(num_source)))):
            return None  # every row of the source, in order (one detokenizer)
        return np.asarray(firsts, np.int64)  # its requests spread over detokenizers
    runs = np.asarray([count for count in counts if count], np.int64)  # [S]
    offsets = np.cumsum(runs) - runs  # each run's first row in the batch's columns
    index = np.repeat(np.asarray(firsts, np.int64) - offsets, runs) + np.arange(int(runs.sum()))
    return None if are_all_rows(index, num_source) else index


def _verify_counts(outputs: list[RequestOutput]) -> NDArray | None:
    """i32 [R], cumulative verify passes per request; absent when no request runs speculatively."""
    if all(o.spec_verify_ct is None for o in outputs):
        return None
    return to_wire(np.asarray([o.spec_verify_ct or 0 for o in outputs], np.int32))
