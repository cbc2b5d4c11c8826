"""The one logprob layout: `LogprobColumns`' checks on decode, and each request's rows through
`to_columns` / `from_columns` (the one encoder and decoder). The scheduler's side:
tests/services/scheduler/test_scheduler_units.py and test_wire_columns.py; the detokenizer's:
tests/services/detokenizer/test_detok_core.py."""

from __future__ import annotations

import re

import msgspec
import numpy as np
import pytest

from contracts.logprobs import LogprobColumns
from services.common.arrays import from_wire, to_wire
from services.common.logprob_rows import RequestLogprobs, RowLogprobs, RowSpan, from_columns, to_columns
from tests.services.detokenizer.conftest import token_batch

ENCODE = msgspec.msgpack.Encoder().encode


def rows(n: int, k: int, m: int, seed: int, start: int = 0) -> RowLogprobs:
    """A request's rows as the scheduler holds them (numpy; top-k / ids of width 0 where not asked)."""
    rng = np.random.default_rng(seed)
    return RowLogprobs.of(-rng.random(n, dtype=np.float32), -rng.random((n, k), dtype=np.float32),
                          rng.integers(0, 2048, (n, k), dtype=np.int32), -rng.random((n, m), dtype=np.float32), start)  # fmt: skip


def test_columns_read_back_into_each_requests_rows() -> None:
    held = [rows(1, 20, 0, 1), None, rows(3, 0, 0, 2), rows(2, 5, 4, 3)]
    columns = msgspec.msgpack.decode(ENCODE(to_columns(held)), type=LogprobColumns)  # through the wire
    assert from_wire(columns.rows).tolist() == [1, 0, 3, 2] and from_wire(columns.top_k).tolist() == [20, 0, 0, 5]
    back = from_columns(columns, len(held))
    for want, got in zip(held, back, strict=True):
        assert (want is None) == (got is None)
        for name in ("token", "top_values", "top_ids", "ids") if want is not None else ():
            assert getattr(got, name).dtype == getattr(want, name).dtype and getattr(got, name).shape == getattr(want, name).shape
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_no_rows_no_columns_and_no_top_k_no_top_columns() -> None:
    assert to_columns([None, None]) is None and to_columns([]) is None
    columns = to_columns([rows(2, 0, 0, 0)])
    assert columns.top_k is None and columns.top_values is None and columns.num_ids is None and columns.start is None


def test_spans_of_one_source_travel_as_its_columns_or_one_gather() -> None:
    source = rows(4, 3, 1, 5)
    every = to_columns([RowSpan(source, 0, 1), RowSpan(source, 1, 1), RowSpan(source, 2, 2)])
    assert from_wire(every.rows).tolist() == [1, 1, 2]
    np.testing.assert_array_equal(from_wire(every.top_values), source.top_values.reshape(-1))  # the source as it is
    some = from_columns(to_columns([RowSpan(source, 3, 1), None, RowSpan(source, 0, 1)]), 3)
    np.testing.assert_array_equal(some[0].token, source.token[3:])
    np.testing.assert_array_equal(some[2].ids, source.ids[:1])
    assert some[1] is None


def i32(*values: int):
    return to_wire(np.array(values, dtype=np.int32))


def f32(size: int):
    return to_wire(np.zeros(size, dtype=np.float32))


@pytest.mark.parametrize(("fields", "message"), [
    ({"rows": i32(1, -1), "token": f32(0)}, "rows must be >= 0"),
    ({"rows": i32(1, 2), "token": f32(2)}, "sum(rows)"),
    ({"rows": i32(1, 2), "token": f32(3), "top_values": f32(3), "top_ids": i32(1, 2, 3)}, "need their widths"),
    ({"rows": i32(1, 2), "token": f32(3), "top_k": i32(1, 1), "top_values": f32(3), "top_ids": i32(1, 2)}, "sum(rows * widths) = 3"),
    ({"rows": i32(1, 2), "token": f32(3), "top_k": i32(1), "top_values": f32(1), "top_ids": i32(1)}, "of 2 entries"),
    ({"rows": i32(1, 2), "token": f32(3), "num_ids": i32(0, 2), "ids": f32(3)}, "= 4"),
    ({"rows": i32(1, 2), "token": f32(3), "start": i32(0)}, "start must be an int32 vector of 2 entries"),
])  # fmt: skip
def test_columns_that_do_not_add_up_are_rejected_on_decode(fields, message) -> None:
    with pytest.raises(msgspec.ValidationError, match=re.escape(message)):
        msgspec.msgpack.decode(ENCODE(fields), type=LogprobColumns)


def test_a_batch_rejects_output_rows_other_than_its_new_tokens_and_columns_of_other_sizes() -> None:
    with pytest.raises(ValueError, match="must be its new tokens"):
        token_batch([("a", [1], None), ("b", [], None)], logprobs=[RequestLogprobs(output=rows(2, 1, 0, 0)), None])
    with pytest.raises(ValueError, match="must have 2 requests"):
        batch = token_batch([("a", [1], None), ("b", [], None)])
        msgspec.structs.replace(batch, prompt_logprobs=to_columns([rows(2, 1, 0, 0)]))
