"""PRODUCT §5: prompt top logprobs as flat row-major arrays, built and validated in one place.

Position p (>= null_prefix), entry j of the top-k list lives at index (p - null_prefix) * k + j
of the flattened arrays: a request's top-k rows of the one logprob layout (`RowLogprobs` with no
`token`, its `start` the null prefix), which travel as `TokenBatch.prompt_top_flat`. Every caller (the scheduler when the last prefill chunk is done, the
tokenizer for its fallback path) builds them with `build_flat_top_logprobs`; whatever it cannot
represent raises `FlatLogprobsError` and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.common.logprob_rows import RowLogprobs

INT32_MAX = np.iinfo(np.int32).max

Rows = np.ndarray | Sequence[Sequence[float] | np.ndarray | None]


class FlatLogprobsError(ValueError):
    """The rows cannot be represented as flat [rows, k] arrays: the message says which row and why.

    Raised for: a negative or non-integer k; value and id inputs with different row counts or null
    positions; a non-null row whose length is not k; a null row after a non-null one; a value that
    is not a number or is NaN inside a non-null row; an id that is not an integer in [0, 2**31).
    """


def build_flat_top_logprobs(values: Rows, ids: Rows, k: int) -> RowLogprobs:
    """Rows are sequences (a null row is None) or 2-D arrays (a null row is all-NaN / all -1). The
    result: top-k rows only (`token` None), the rows after the null prefix, `start` the prefix."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
        raise FlatLogprobsError(f"k must be a non-negative integer; got {k!r}")
    value_nulls, value_rows = _split_nulls(values, k, "values", _null_value_rows)
    id_nulls, id_rows = _split_nulls(ids, k, "ids", _null_id_rows)
    if len(value_nulls) != len(id_nulls):
        raise FlatLogprobsError(f"{len(value_nulls)} value rows but {len(id_nulls)} id rows")
    if not np.array_equal(value_nulls, id_nulls):
        raise FlatLogprobsError("value rows and id rows are null at different positions")
    null_prefix = _null_prefix(value_nulls)
    return RowLogprobs.of(None, _as_values(value_rows, k, null_prefix), _as_ids(id_rows, k, null_prefix), start=null_prefix)


def _split_nulls(rows: Rows, k: int, name: str, null_rows) -> tuple[np.ndarray, list | np.ndarray]:
    """-> (bool [rows] null flags, the non-null rows)."""
    if isinstance(rows, np.ndarray):
        if rows.ndim != 2 or (rows.shape[0] > 0 and rows.shape[1] != k):
            raise FlatLogprobsError(f"{name}: expected a [rows, {k}] array; got shape {rows.shape}")
        nulls = null_rows(rows) if k > 0 else np.zeros(rows.shape[0], dtype=bool)  # [rows]
        return nulls, rows[~nulls]
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
        raise FlatLogprobsError(f"{name}: expected a sequence of rows or a 2-D array; got {type(rows).__name__}")
    nulls = np.array([row is None for row in rows], dtype=bool)
    return nulls, [row for row in rows if row is not None]


def _null_value_rows(rows: np.ndarray) -> np.ndarray:
    if rows.dtype.kind != "f":
        return np.zeros(rows.shape[0], dtype=bool)
    return np.isnan(rows).all(axis=1)


def _null_id_rows(rows: np.ndarray) -> np.ndarray:
    if rows.dtype.kind not in "iuf":
        return np.zeros(rows.shape[0], dtype=bool)
    return (rows == -1).all(axis=1)


def _null_prefix(nulls: np.ndarray) -> int:
    prefix = len(nulls) if nulls.all() else int(np.argmax(~nulls))
    if nulls[prefix:].any():
        interior = prefix + int(np.argmax(nulls[prefix:]))
        raise FlatLogprobsError(f"row {interior} is null but follows a non-null row (nulls only lead)")
    return prefix


def _as_values(rows: list, k: int, null_prefix: int) -> np.ndarray:
    array = _as_matrix(rows, k, null_prefix, "values")  # [rows, k]
    if array.dtype.kind not in "iuf":
        raise FlatLogprobsError(f"values: expected numbers; got dtype {array.dtype}")
    if np.isnan(array).any():
        row = int(np.isnan(array).any(axis=1).argmax())
        raise FlatLogprobsError(f"values: row {null_prefix + row} has NaN among non-null entries")
    return np.ascontiguousarray(array, dtype=np.float32)


def _as_ids(rows: list, k: int, null_prefix: int) -> np.ndarray:
    array = _as_matrix(rows, k, null_prefix, "ids")  # [rows, k]
    if array.dtype.kind == "f" and array.size and not np.isfinite(array).all():
        raise FlatLogprobsError("ids: not finite")
    if array.dtype.kind not in "iuf" or (array.dtype.kind == "f" and (array != np.floor(array)).any()):
        raise FlatLogprobsError(f"ids: expected integers; got dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() > INT32_MAX):
        raise FlatLogprobsError(f"ids: outside [0, {INT32_MAX}]")
    return np.ascontiguousarray(array, dtype=np.int32)


def _as_matrix(rows: list | np.ndarray, k: int, null_prefix: int, name: str) -> np.ndarray:
    if isinstance(rows, np.ndarray):
        return rows  # shape already checked: [rows, k]
    for index, row in enumerate(rows):
        if isinstance(row, str | bytes) or not hasattr(row, "__len__") or len(row) != k:
            length = len(row) if hasattr(row, "__len__") else type(row).__name__
            raise FlatLogprobsError(f"{name}: row {null_prefix + index} has length {length}, expected k={k}")
    if not rows:
        return np.zeros((0, k), dtype=np.float64)
    try:
        array = np.array([np.asarray(row) for row in rows]).reshape(len(rows), k)
    except (ValueError, TypeError) as exc:
        raise FlatLogprobsError(f"{name}: rows are not numeric: {exc}") from None
    if array.dtype == np.bool_:
        raise FlatLogprobsError(f"{name}: expected numbers; got booleans")
    return array
