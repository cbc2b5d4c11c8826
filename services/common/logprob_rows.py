"""Each request's logprob rows, and the one way they become the wire's columns and back.

`RowLogprobs` is the layout of `contracts.logprobs.LogprobColumns` for one request's rows (or one
query's, on the device): its kinds as 2-D arrays of one width each, generic over the array type
(`torch.Tensor` on the device before a step's readback, `np.ndarray` on the host). `RowSpan` is a
request's rows inside a step's host columns, read only where needed. `RequestLogprobs` is what one
request gets in one step: its output rows, its prompt rows, its flat prompt arrays (PRODUCT §5).

`to_columns` is the one encoder (a batch's requests' rows -> `LogprobColumns`), `from_columns`
the one decoder (the columns -> each request's rows, views of the received bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import msgspec
import numpy as np

from contracts.arrays import NDArray
from contracts.logprobs import LogprobColumns
from services.common.arrays import from_wire, to_wire

Array = TypeVar("Array")  # np.ndarray on the host; torch.Tensor on the device, before the step's readback


class RowLogprobs(msgspec.Struct, Generic[Array], frozen=True, gc=False):
    """Logprobs of n rows: the row's own token's, the top-k (sorted, ties by id), the requested ids'."""

    token: Array | None  # f32 [n]; None: top-k rows only (the flat prompt arrays)
    top_values: Array  # f32 [n, k]
    top_ids: Array  # i32 [n, k]
    ids: Array  # f32 [n, m]
    start: int = 0  # the first row's position where the rows have one (`LogprobColumns.start`)

    @classmethod
    def of(cls, token: np.ndarray | None, top_values: np.ndarray | None = None, top_ids: np.ndarray | None = None,
           ids: np.ndarray | None = None, start: int = 0) -> RowLogprobs:  # fmt: skip
        """Host rows with the columns not given empty (k = 0, m = 0)."""
        n = len(token) if token is not None else len(top_values)
        return cls(
            token,
            np.zeros((n, 0), np.float32) if top_values is None else top_values,
            np.zeros((n, 0), np.int32) if top_ids is None else top_ids,
            np.zeros((n, 0), np.float32) if ids is None else ids,
            start,
        )

    @property
    def num_rows(self) -> int:
        return len(self.top_values) if self.token is None else len(self.token)

    @property
    def k(self) -> int:
        return self.top_values.shape[1]

    @property
    def m(self) -> int:
        return self.ids.shape[1]

    def columns(self) -> tuple[Array, Array, Array, Array]:
        """The four kinds, in field order: what the readback carries."""
        return self.token, self.top_values, self.top_ids, self.ids

    def head(self, n: int) -> RowLogprobs:
        if n >= self.num_rows:
            return self
        token = None if self.token is None else self.token[:n]
        return RowLogprobs(token, self.top_values[:n], self.top_ids[:n], self.ids[:n], self.start)

    def with_null_row(self) -> RowLogprobs:
        """Prepend the null entry of the first returned prompt position: NaN values, -1 ids."""
        k, m = self.top_values.shape[1], self.ids.shape[1]
        return RowLogprobs(
            token=np.concatenate([np.full(1, np.nan, np.float32), self.token]),
            top_values=np.concatenate([np.full((1, k), np.nan, np.float32), self.top_values]),
            top_ids=np.concatenate([np.full((1, k), -1, np.int32), self.top_ids]),
            ids=np.concatenate([np.full((1, m), np.nan, np.float32), self.ids]),
            start=self.start,
        )

    def at(self, start: int) -> RowLogprobs:
        return msgspec.structs.replace(self, start=start)

    @staticmethod
    def joined(parts: Sequence[RowLogprobs | RowSpan]) -> RowLogprobs:
        """Several steps' rows of one request as one: each kind concatenated, the first start."""
        if len(parts) == 1:
            return parts[0] if parts[0].__class__ is RowLogprobs else parts[0].rows()
        token = None if parts[0].token is None else np.concatenate([p.token for p in parts])
        return RowLogprobs(token, *(np.concatenate([getattr(p, kind) for p in parts]) for kind in ("top_values", "top_ids", "ids")),
                           parts[0].start)  # fmt: skip


class _SpanColumn:
    """A `RowSpan`'s column of the name it is bound to: the source's, cut to the span's rows (a
    view, made when read)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, span: RowSpan | None, owner: type | None = None):
        if span is None:
            return self  # read on the class
        return getattr(span.source, self.name)[span.first : span.first + span.count]


class RowSpan(msgspec.Struct, frozen=True, gc=False):
    """`count` rows of a step's host columns from row `first`, read as `RowLogprobs` reads (each
    column a view, made when read): one small object a request a step instead of four views, and
    `to_columns` sends a batch's spans of one source as that source's columns, or one gather."""

    source: RowLogprobs[np.ndarray]
    first: int
    count: int

    token = _SpanColumn()  # f32 [count]
    top_values = _SpanColumn()  # f32 [count, k]
    top_ids = _SpanColumn()  # i32 [count, k]
    ids = _SpanColumn()  # f32 [count, m]
    start = 0

    @property
    def num_rows(self) -> int:
        return self.count

    @property
    def k(self) -> int:
        return self.source.top_values.shape[1]

    @property
    def m(self) -> int:
        return self.source.ids.shape[1]

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.token, self.top_values, self.top_ids, self.ids

    def head(self, n: int) -> RowSpan:
        return self if n >= self.count else RowSpan(self.source, self.first, n)

    def with_null_row(self) -> RowLogprobs:
        return self.rows().with_null_row()

    def rows(self) -> RowLogprobs:
        """As rows of their own (views)."""
        return RowLogprobs(self.token, self.top_values, self.top_ids, self.ids)


HostRows = RowLogprobs | RowSpan  # a request's rows of one step, on the host


class RequestLogprobs(msgspec.Struct):
    """One request's logprob rows new in one step: output rows (one per new token), prompt rows
    (`start`: their first position), and the flat prompt top-k arrays, sent once (PRODUCT §5;
    `start`: the null prefix). (A mutable `msgspec.Struct`: one is made per request per step.)"""

    output: HostRows | None = None
    prompt: HostRows | None = None
    flat: RowLogprobs | None = None

    def is_empty(self) -> bool:
        return self.output is None and self.prompt is None and self.flat is None


def are_all_rows(rows: np.ndarray, num_source_rows: int | None) -> bool:
    """rows == 0, 1, ..., num_source_rows - 1: a source's every row, in order (nothing to gather)."""
    return rows.size == num_source_rows and bool((rows == np.arange(rows.size)).all())


def to_columns(rows: Sequence[HostRows | None]) -> LogprobColumns | None:
    """The rows of every request of a batch (None: none this step) as the batch's columns; None
    when no request has any. Spans of one step's columns (the commonest batch: a decode step's
    output rows) are that source's columns as they are, or one gather of them."""
    present = [r for r in rows if r is not None]
    if not present:
        return None  # (`rows` may be empty: nothing of that kind in the batch)
    source = present[0].source if present[0].__class__ is RowSpan else None
    if source is not None and all(r.__class__ is RowSpan and r.source is source for r in present):
        return _span_columns(rows, source)
    return _joined_columns(rows, present)


def from_columns(columns: LogprobColumns | None, count: int) -> list[RowLogprobs | None]:
    """Each of the batch's `count` requests' rows (None: none), views of the received bytes (no
    copy: this runs per request per step in the detokenizer and the tokenizer)."""
    if columns is None:
        return [None] * count
    rows = from_wire(columns.rows).tolist()
    top_k, num_ids, start = _widths(columns.top_k, count), _widths(columns.num_ids, count), _widths(columns.start, count)
    token, top_values, top_ids, ids = (_flat(getattr(columns, kind)) for kind in ("token", "top_values", "top_ids", "ids"))
    out: list[RowLogprobs | None] = []
    at = top_at = ids_at = 0
    for n, k, m, first in zip(rows, top_k, num_ids, start, strict=True):
        if n == 0:
            out.append(None)
            continue
        out.append(RowLogprobs(
            None if token is None else token[at : at + n],
            _block(top_values, top_at, n, k, np.float32), _block(top_ids, top_at, n, k, np.int32),
            _block(ids, ids_at, n, m, np.float32), first,
        ))  # fmt: skip
        at, top_at, ids_at = at + n, top_at + n * k, ids_at + n * m
    return out


def _span_columns(rows: Sequence[RowSpan | None], source: RowLogprobs) -> LogprobColumns:
    counts = [0 if r is None else r.count for r in rows]
    index = _source_rows([r.first for r in rows if r is not None and r.count], counts, len(source.top_values))

    def pick(column: np.ndarray) -> np.ndarray:
        return column if index is None else column[index]

    rows_of = np.asarray(counts, np.int32)  # [R]
    has_rows = np.minimum(rows_of, 1)  # i32 [R]: 1 where a request has rows (its widths are the source's)
    k, m = source.top_values.shape[1], source.ids.shape[1]
    return _columns(rows_of, None if source.token is None else pick(source.token),
                    (has_rows * k, pick(source.top_values), pick(source.top_ids)) if k else None,
                    (has_rows * m, pick(source.ids)) if m else None, None)  # fmt: skip


def _joined_columns(rows: Sequence[HostRows | None], present: list[HostRows]) -> LogprobColumns:
    rows_of = np.asarray([0 if r is None else r.num_rows for r in rows], np.int32)
    top_k = np.asarray([0 if r is None else r.k for r in rows], np.int32)
    num_ids = np.asarray([0 if r is None else r.m for r in rows], np.int32)
    token = None if present[0].token is None else _flat_join([r.token for r in present])
    top = (top_k, _flat_join([r.top_values for r in present]), _flat_join([r.top_ids for r in present])) if top_k.any() else None
    requested = (num_ids, _flat_join([r.ids for r in present])) if num_ids.any() else None
    starts = [0 if r is None else r.start for r in rows]
    return _columns(rows_of, token, top, requested, np.asarray(starts, np.int32) if any(starts) else None)


def _columns(rows: np.ndarray, token: np.ndarray | None, top: tuple | None, requested: tuple | None,
             start: np.ndarray | None) -> LogprobColumns:  # fmt: skip
    fields: dict[str, NDArray] = {"rows": to_wire(rows)}
    if token is not None:
        fields["token"] = to_wire(token.astype(np.float32, copy=False))
    if top is not None:
        widths, values, ids = top
        fields |= {"top_k": to_wire(widths.astype(np.int32, copy=False)),
                   "top_values": to_wire(values.reshape(-1).astype(np.float32, copy=False)),
                   "top_ids": to_wire(ids.reshape(-1).astype(np.int32, copy=False))}  # fmt: skip
    if requested is not None:
        widths, values = requested
        fields |= {"num_ids": to_wire(widths.astype(np.int32, copy=False)), "ids": to_wire(values.reshape(-1).astype(np.float32, copy=False))}
    if start is not None:
        fields["start"] = to_wire(start)
    return LogprobColumns(**fields)


def _flat_join(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays' values in order, as one vector: one concatenate when they share their width (the
    usual batch: one k for all); one array's, as a view."""
    if len(arrays) == 1:
        return arrays[0].reshape(-1)
    if arrays[0].ndim == 1 or len({a.shape[1] for a in arrays}) == 1:
        return np.concatenate(arrays).reshape(-1)
    return np.concatenate([a.reshape(-1) for a in arrays])


def _source_rows(firsts: list[int], counts: list[int], num_source: int) -> np.ndarray | None:
    """The source's rows of requests' runs (first rows of the runs, and every request's count, 0
    for those without rows), in order; None when they are all of its rows in order (nothing to
    gather: a decode step's one row per request, one destination)."""
    if len(firsts) == sum(counts):  # one row a run (a decode step)
        if len(firsts) == num_source and (not firsts or (firsts[-1] == num_source - 1 and firsts == list(range(num_source)))):
            return None
        return np.asarray(firsts, np.int64)
    runs = np.asarray([count for count in counts if count], np.int64)  # [S]
    offsets = np.cumsum(runs) - runs  # each run's first row in the batch's columns
    index = np.repeat(np.asarray(firsts, np.int64) - offsets, runs) + np.arange(int(runs.sum()))
    return None if are_all_rows(index, num_source) else index


def _widths(column: NDArray | None, count: int) -> list[int]:
    return from_wire(column).tolist() if column is not None else [0] * count


def _flat(column: NDArray | None) -> np.ndarray | None:
    return None if column is None else from_wire(column)


def _block(values: np.ndarray | None, at: int, n: int, width: int, dtype) -> np.ndarray:
    """[n, width] of a flat column from entry `at` (a view); [n, 0] where the batch has none."""
    if values is None or width == 0:
        return np.zeros((n, 0), dtype)
    return values[at : at + n * width].reshape(n, width)
