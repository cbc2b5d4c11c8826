"""The one logprob layout on the wire: rows of several requests, one array per kind.

Every logprob a batch carries travels in this form: a step's output rows, its prompt rows, and
the flat prompt top-k arrays of PRODUCT §5 are each one `LogprobColumns` over the batch's
requests (`TokenBatch`, `TextBatch`). `services.common.logprob_rows` builds them from and reads
them into each request's rows (`RowLogprobs`: the same layout, one request's, as 2-D views).
"""

from __future__ import annotations

import operator

import msgspec

from contracts.arrays import NDArray


class LogprobColumns(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """Logprob entries of the rows of R requests, request after request.

    Request i owns `rows[i]` rows: their `token` values (each row's logprob of its own token: the
    prompt's next token, or the token sampled from the row), `rows[i] * top_k[i]` entries of
    `top_values` / `top_ids` (each row's top-k, row-major, sorted by logprob, ties by the smaller
    id) and `rows[i] * num_ids[i]` of `ids` (the logprobs of the token ids the request asked for,
    in its order). `start[i]` is the position of its first row where the rows have one (prompt
    rows: in the prompt; the flat prompt arrays: the null prefix, PRODUCT §5). A kind that no
    request of the batch has is absent with its widths (the flat arrays have no `token`).

    Null rows (nothing predicts a prompt's first token) are NaN values and -1 ids. With
    `--logprobs-mode processed`, tokens the request's top-k / top-p / min-p remove carry -9999.0.
    """

    rows: NDArray  # i32 [R]
    token: NDArray | None = None  # f32 [sum(rows)]
    top_k: NDArray | None = None  # i32 [R]
    top_values: NDArray | None = None  # f32 [sum(rows * top_k)]
    top_ids: NDArray | None = None  # i32 [sum(rows * top_k)]
    num_ids: NDArray | None = None  # i32 [R]
    ids: NDArray | None = None  # f32 [sum(rows * num_ids)]
    start: NDArray | None = None  # i32 [R]

    def __post_init__(self) -> None:
        """Invariant: every width column is an R-vector >= 0 and every value column holds exactly
        its rows' entries, so readers slice without checking again."""
        rows = int32s(self.rows, "rows")
        if min(rows, default=0) < 0:
            raise ValueError("rows must be >= 0")
        if self.token is not None and not self.token.is_vector("<f4", sum(rows)):
            raise ValueError("token must be an f32 vector of sum(rows)")
        if self.start is not None:
            int32s(self.start, "start", len(rows))
        for widths, values, dtypes in ((self.top_k, (self.top_values, self.top_ids), ("<f4", "<i4")),
                                       (self.num_ids, (self.ids,), ("<f4",))):  # fmt: skip
            if widths is None:
                if any(v is not None for v in values):
                    raise ValueError("logprob values need their widths")
                continue
            counts = int32s(widths, "widths", len(rows))
            if min(counts, default=0) < 0:
                raise ValueError("widths must be >= 0")
            size = sum(map(operator.mul, rows, counts))  # both of len(rows) (`int32s`)
            if not all(v is not None and v.is_vector(d, size) for v, d in zip(values, dtypes, strict=True)):
                raise ValueError(f"logprob values must be vectors of sum(rows * widths) = {size}")

    def num_requests(self) -> int:
        return self.rows.shape[0]


def int32s(column: NDArray, name: str, count: int | None = None) -> list[int]:
    """An i32 vector's values (of `count` entries, when given); ValueError otherwise."""
    if not column.is_vector("<i4", count):
        raise ValueError(f"{name} must be an int32 vector" + (f" of {count} entries" if count is not None else ""))
    return memoryview(column.data).cast("B").cast("i").tolist()  # little-endian hosts only, as numpy's views
