"""Messages the detokenizer receives: registrations from tokenizers, token batches from schedulers."""

from __future__ import annotations

import enum
import operator
from typing import Annotated

import msgspec

from contracts.arrays import NDArray
from contracts.limits import (
    MAX_STOP_STRINGS,
    Count,
    InstanceId,
    Reason,
    Rid,
    StopString,
    TokenId,
)


class FinishType(enum.IntEnum):
    STOP = 0  # eos, a stop token id or a stop string
    LENGTH = 1  # max_new_tokens or max_model_len
    ABORT = 2  # client gone, scheduler error, shutdown


class Finish(msgspec.Struct, frozen=True, gc=False, array_like=True):
    type: FinishType
    matched: TokenId | StopString | None = None  # the stop token id or stop string that ended the request
    message: Reason | None = None  # for ABORT: why, in words a user can act on


class DetokenizeParams(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    stop: Annotated[tuple[StopString, ...], msgspec.Meta(max_length=MAX_STOP_STRINGS)] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text
    min_tokens: Count = 0  # vLLM: a stop string ending in the first min_tokens output tokens is no stop


class DetokenizerRegistration(msgspec.Struct, frozen=True, gc=False):
    """Request (queue group): one detokenizer takes ownership of `rid` before any token exists."""

    rid: Rid
    tokenizer_id: InstanceId  # outputs go to `subjects.tokenizer_outputs(tokenizer_id)`
    params: DetokenizeParams


class DetokenizerRegistrationReply(msgspec.Struct, frozen=True, gc=False):
    detokenizer_id: InstanceId


class RequestLogprobs(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """One request's logprob entries that are new in one step. Every field optional.

    Null positions (nothing predicts the first prompt token) are NaN in value arrays and -1 in id
    arrays. Top-k rows are sorted by logprob, ties by token id. `k` is the request's
    `top_logprobs_num`; `m` is `len(token_ids_logprob)` (the ids themselves are in the request).
    With `--logprobs-mode processed`, tokens the request's top-k/top-p/min-p remove carry -9999.0.

    New fields are appended with a `None` default: with `omit_defaults` an old message encodes to
    the same bytes, and an old reader skips fields it does not know.
    """

    # Output positions new in this step (n = the request's new token count in the batch).
    output_token_logprobs: NDArray | None = None  # f32 [n]
    output_top_logprobs: NDArray | None = None  # f32 [n, k]
    output_top_ids: NDArray | None = None  # i32 [n, k]
    output_ids_logprobs: NDArray | None = None  # f32 [n, m]
    # Prompt positions new in this step: [input_start, input_start + p) of the prompt.
    input_start: Count | None = None
    input_token_logprobs: NDArray | None = None  # f32 [p]
    input_top_logprobs: NDArray | None = None  # f32 [p, k]
    input_top_ids: NDArray | None = None  # i32 [p, k]
    input_ids_logprobs: NDArray | None = None  # f32 [p, m]
    # PRODUCT §5, opted-in requests only, sent once when the last prefill chunk is done; then the
    # nested `input_top_*` fields above stay None for that request.
    input_top_logprobs_flat: NDArray | None = None  # f32 [rows, k], rows after the null prefix
    input_top_ids_flat: NDArray | None = None  # i32 [rows, k]
    input_top_null_prefix: Count | None = None

    def __post_init__(self) -> None:
        """Invariant: arrays of one kind of position agree on their row count, top-k values and
        ids on their shape, so readers slice and format them without checking again."""
        _check_rows([self.output_token_logprobs, self.output_top_logprobs, self.output_top_ids, self.output_ids_logprobs])
        _check_rows([self.input_token_logprobs, self.input_top_logprobs, self.input_top_ids, self.input_ids_logprobs])
        _check_pair(self.output_top_logprobs, self.output_top_ids)
        _check_pair(self.input_top_logprobs, self.input_top_ids)
        _check_pair(self.input_top_logprobs_flat, self.input_top_ids_flat)
        if (self.input_top_logprobs_flat is None) != (self.input_top_ids_flat is None):
            raise ValueError("flat prompt top logprobs need both values and ids")

    def num_output_rows(self) -> int | None:
        for array in (self.output_token_logprobs, self.output_top_logprobs, self.output_top_ids, self.output_ids_logprobs):
            if array is not None:
                return array.shape[0]
        return None


class OutputLogprobColumns(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """The output logprob entries new in one step of every request of a `TokenBatch`, one array per
    kind (`services.common.output_logprob_columns` builds and reads them). Over the batch's R
    requests: request i owns `rows[i]` rows (its new tokens if it asked for logprobs, else 0), in
    request order, of `token_logprobs`, `rows[i] * top_k[i]` values of `top_logprobs` / `top_ids`
    (row-major [rows, k]) and `rows[i] * num_ids[i]` of `ids_logprobs`. The width columns and their
    values are absent when no request of the batch has any. Values as in `RequestLogprobs`."""

    rows: NDArray  # i32 [R]
    token_logprobs: NDArray  # f32 [sum(rows)]
    top_k: NDArray | None = None  # i32 [R]
    top_logprobs: NDArray | None = None  # f32 [sum(rows * top_k)]
    top_ids: NDArray | None = None  # i32 [sum(rows * top_k)]
    num_ids: NDArray | None = None  # i32 [R]
    ids_logprobs: NDArray | None = None  # f32 [sum(rows * num_ids)]

    def __post_init__(self) -> None:
        """Invariant: the widths are R-vectors >= 0 and every value column holds exactly its rows'
        entries, so readers slice without checking again."""
        rows = _int32s(self.rows, "rows")
        if min(rows, default=0) < 0 or not self.token_logprobs.is_vector("<f4", sum(rows)):
            raise ValueError("rows must be >= 0 and token_logprobs an f32 vector of sum(rows)")
        for widths, values, dtypes in ((self.top_k, (self.top_logprobs, self.top_ids), ("<f4", "<i4")),
                                       (self.num_ids, (self.ids_logprobs,), ("<f4",))):  # fmt: skip
            if widths is None:
                if any(v is not None for v in values):
                    raise ValueError("logprob values need their widths")
                continue
            counts = _int32s(widths, "widths", len(rows))
            if min(counts, default=0) < 0:
                raise ValueError("widths must be >= 0")
            size = sum(map(operator.mul, rows, counts))  # both of len(rows) (`_int32s`)
            if not all(v is not None and v.is_vector(d, size) for v, d in zip(values, dtypes, strict=True)):
                raise ValueError(f"logprob values must be vectors of sum(rows * widths) = {size}")

    def num_requests(self) -> int:
        return self.rows.shape[0]


class TokenBatch(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """One scheduler step's output for one detokenizer, columnar over the R requests in it.

    Requests are ragged: request i owns `new_token_ids[offsets[i]:offsets[i+1]]` where
    `offsets = [0, *cumsum(num_new_tokens)]` (0 new tokens is valid: a prefill chunk).
    """

    scheduler_id: InstanceId
    step: Count
    rids: list[Rid]  # [R]
    num_new_tokens: NDArray  # i32 [R]
    new_token_ids: NDArray  # i32 [sum(num_new_tokens)]
    prompt_tokens: NDArray  # i32 [R]
    finish: list[Finish | None]  # [R]; None while running
    logprobs: list[RequestLogprobs | None] | None = None  # [R]; None when nobody asked (or see output_logprobs)
    spec_verify_ct: NDArray | None = None  # i32 [R], cumulative verify passes (speculative only)
    # Appended (schema evolution): the output entries of this step, columnar; then no entry of
    # `logprobs` holds output rows: a request's entries are its `logprobs` entry (prompt entries,
    # or None) and its rows here together, and `logprobs` is None when no request has prompt
    # entries. A reader that predates the field finds the output entries missing, not wrong.
    output_logprobs: OutputLogprobColumns | None = None

    def __post_init__(self) -> None:
        counts = check_columns(self.rids, self.num_new_tokens, self.new_token_ids, self.prompt_tokens, self.finish,
                               self.logprobs, self.spec_verify_ct)  # fmt: skip
        if self.output_logprobs is not None:
            rows = _int32s(self.output_logprobs.rows, "output_logprobs.rows", len(self.rids))
            # (the commonest batch, every request with rows, is equal lists: one C comparison)
            if rows != counts and any(n not in (0, c) for n, c in zip(rows, counts, strict=True)):
                raise ValueError("a request's output logprob rows must be its new tokens")
            if any(entry is not None and entry.num_output_rows() is not None for entry in self.logprobs or ()):
                raise ValueError("output logprob entries go in output_logprobs or in logprobs, not both")


def check_columns(
    rids: list[str],
    num_new_tokens: NDArray,
    new_token_ids: NDArray,
    prompt_tokens: NDArray,
    finish: list[Finish | None],
    logprobs: list[RequestLogprobs | None] | None,
    spec_verify_ct: NDArray | None,
) -> list[int]:
    """Invariant of the ragged columnar batches (`TokenBatch`, `TextBatch`): every column has R
    entries, the counts are >= 0 and add up to the ids, and a request's output logprob rows are
    its new tokens. Returns the counts (`num_new_tokens`); raises ValueError (on decode: the
    message is rejected)."""
    count = len(rids)
    for name, column in (("num_new_tokens", num_new_tokens), ("prompt_tokens", prompt_tokens),
                         ("spec_verify_ct", spec_verify_ct)):  # fmt: skip
        if column is not None and not column.is_vector("<i4", count):
            raise ValueError(f"{name} must be an int32 vector of {count} entries")
    if len(finish) != count or (logprobs is not None and len(logprobs) != count):
        raise ValueError(f"finish and logprobs must have {count} entries")
    counts = _int32s(num_new_tokens, "num_new_tokens")
    if min(counts, default=0) < 0 or not new_token_ids.is_vector("<i4", sum(counts)):
        raise ValueError("num_new_tokens must be >= 0 and add up to new_token_ids")
    for num, entry in zip(counts, logprobs or (), strict=False):
        if entry is not None and entry.num_output_rows() not in (None, num):
            raise ValueError("output logprob rows must match the request's new tokens")
    return counts


def _int32s(column: NDArray, name: str, count: int | None = None) -> list[int]:
    if not column.is_vector("<i4", count):
        raise ValueError(f"{name} must be an int32 vector" + (f" of {count} entries" if count is not None else ""))
    return memoryview(column.data).cast("B").cast("i").tolist()  # little-endian hosts only, as numpy's views


def _check_rows(arrays: list[NDArray | None]) -> None:
    rows = None
    for array in arrays:
        if array is None:
            continue
        if not array.shape or rows not in (None, array.shape[0]):
            raise ValueError("logprob arrays of the same positions must have the same number of rows")
        rows = array.shape[0]


def _check_pair(values: NDArray | None, ids: NDArray | None) -> None:
    if values is not None and ids is not None and values.shape != ids.shape:
        raise ValueError("top-k values and ids must have the same shape")
