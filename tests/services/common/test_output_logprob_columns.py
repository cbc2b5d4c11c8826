"""`OutputLogprobColumns`: the scheduler's columns (`to_columns`) read back (`per_request`) into the
fields each request's `RequestLogprobs` had, and the contract's checks. The detokenizer's side:
tests/services/detokenizer/test_detok_output_columns.py."""

from __future__ import annotations

import re
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from contracts.detokenizer import OutputLogprobColumns, RequestLogprobs
from services.common.arrays import from_wire, to_wire
from services.common.output_logprob_columns import per_request, to_columns
from services.detokenizer.core import OUTPUT_LOGPROB_FIELDS
from tests.services.detokenizer.conftest import token_batch

ENCODE = msgspec.msgpack.Encoder().encode


def entries(n: int, k: int, m: int, seed: int) -> SimpleNamespace:
    """A request's output entries as the scheduler holds them (numpy; top-k / ids absent at 0)."""
    rng = np.random.default_rng(seed)
    return SimpleNamespace(
        output_token_logprobs=-rng.random(n, dtype=np.float32),
        output_top_logprobs=-rng.random((n, k), dtype=np.float32) if k else None,
        output_top_ids=rng.integers(0, 2048, (n, k), dtype=np.int32) if k else None,
        output_ids_logprobs=-rng.random((n, m), dtype=np.float32) if m else None,
    )


def test_columns_read_back_into_each_requests_arrays() -> None:
    held = [entries(1, 20, 0, 1), None, entries(3, 0, 0, 2), entries(2, 5, 4, 3), SimpleNamespace(**dict.fromkeys(OUTPUT_LOGPROB_FIELDS))]
    columns = msgspec.msgpack.decode(ENCODE(to_columns(held)), type=OutputLogprobColumns)  # through the wire
    assert from_wire(columns.rows).tolist() == [1, 0, 3, 2, 0] and from_wire(columns.top_k).tolist() == [20, 0, 0, 5, 0]
    back = per_request(columns)
    assert [None if b is None else sorted(b) for b in back] == [
        ["output_token_logprobs", "output_top_ids", "output_top_logprobs"], None, ["output_token_logprobs"],
        sorted(OUTPUT_LOGPROB_FIELDS), None]  # fmt: skip
    for want, got in zip(held, back, strict=True):
        for name, array in (got or {}).items():
            assert from_wire(array).dtype == getattr(want, name).dtype
            np.testing.assert_array_equal(from_wire(array), getattr(want, name))


def test_no_output_rows_no_columns_and_no_top_k_no_top_columns() -> None:
    assert to_columns([None, SimpleNamespace(**dict.fromkeys(OUTPUT_LOGPROB_FIELDS))]) is None
    columns = to_columns([entries(2, 0, 0, 0)])
    assert columns.top_k is None and columns.top_logprobs is None and columns.num_ids is None


def i32(*values: int):
    return to_wire(np.array(values, dtype=np.int32))


def f32(size: int):
    return to_wire(np.zeros(size, dtype=np.float32))


@pytest.mark.parametrize(("fields", "message"), [
    ({"rows": i32(1, -1), "token_logprobs": f32(0)}, "rows must be >= 0"),
    ({"rows": i32(1, 2), "token_logprobs": f32(2)}, "sum(rows)"),
    ({"rows": i32(1, 2), "token_logprobs": f32(3), "top_logprobs": f32(3), "top_ids": i32(1, 2, 3)}, "need their widths"),
    ({"rows": i32(1, 2), "token_logprobs": f32(3), "top_k": i32(1, 1), "top_logprobs": f32(3), "top_ids": i32(1, 2)}, "sum(rows * widths) = 3"),
    ({"rows": i32(1, 2), "token_logprobs": f32(3), "top_k": i32(1), "top_logprobs": f32(1), "top_ids": i32(1)}, "of 2 entries"),
    ({"rows": i32(1, 2), "token_logprobs": f32(3), "num_ids": i32(0, 2), "ids_logprobs": f32(3)}, "= 4"),
])  # fmt: skip
def test_columns_that_do_not_add_up_are_rejected_on_decode(fields, message) -> None:
    with pytest.raises(msgspec.ValidationError, match=re.escape(message)):
        msgspec.msgpack.decode(ENCODE(fields), type=OutputLogprobColumns)


def test_a_batch_rejects_rows_other_than_its_new_tokens_and_entries_in_both_places() -> None:
    columns = to_columns([entries(2, 1, 0, 0), None])
    with pytest.raises(ValueError, match="must be its new tokens"):
        msgspec.structs.replace(token_batch([("a", [1], None), ("b", [], None)], logprobs=[RequestLogprobs(), None]), output_logprobs=columns)
    both = RequestLogprobs(output_token_logprobs=f32(2))
    with pytest.raises(ValueError, match="not both"):
        msgspec.structs.replace(token_batch([("a", [1, 2], None), ("b", [], None)], logprobs=[both, None]), output_logprobs=columns)
