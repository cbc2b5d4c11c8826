"""The one shared builder of flat prompt top logprobs (PRODUCT §5)."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.flat_logprobs import FlatLogprobsError, build_flat_top_logprobs

NAN = float("nan")


def test_index_formula_from_nested_rows():
    values = [None, None, [-0.1, -2.0], [-0.3, -0.4], [-1.0, -1.5]]
    ids = [None, None, [5, 6], [7, 8], [9, 1]]
    flat = build_flat_top_logprobs(values, ids, 2)
    assert flat.start == 2 and flat.top_values.shape == (3, 2)
    assert flat.top_values.dtype == np.float32 and flat.top_ids.dtype == np.int32
    flat_values, flat_ids = flat.top_values.ravel(), flat.top_ids.ravel()
    for p in range(2, 5):
        for j in range(2):
            assert flat_values[(p - flat.start) * 2 + j] == np.float32(values[p][j])
            assert flat_ids[(p - flat.start) * 2 + j] == ids[p][j]


def test_arrays_with_nan_and_minus_one_null_rows():
    values = np.array([[NAN, NAN], [-0.5, -0.7]], np.float32)
    ids = np.array([[-1, -1], [3, 4]], np.int32)
    flat = build_flat_top_logprobs(values, ids, 2)
    assert flat.start == 1 and flat.token is None  # top-k rows only, after the null prefix
    np.testing.assert_array_equal(flat.top_ids, [[3, 4]])


def test_all_null_gives_zero_rows():
    flat = build_flat_top_logprobs([None, None], [None, None], 3)
    assert flat.start == 2 and flat.top_values.shape == (0, 3) and flat.top_ids.shape == (0, 3)
    empty = build_flat_top_logprobs(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.int32), 3)
    assert empty.start == 0 and empty.top_values.shape == (0, 3)


@pytest.mark.parametrize(
    "values, ids, match",
    [
        ([[-1.0], None], [[1], None], "null but follows"),  # interior null in both
        ([[-1.0], None], [[1], [2]], "null at different positions"),  # interior null in values only
        ([[-1.0], [-2.0]], [[1], None], "null at different positions"),  # interior null in ids only
        ([[-1.0, -2.0], [-1.0]], [[1, 2], [3, 4]], "values: row 1 has length 1"),  # ragged values
        ([[-1.0, -2.0], [-1.0, -3.0]], [[1, 2], [3]], "ids: row 1 has length 1"),  # ragged ids
        ([[-1.0, -2.0]], [[1, 2], [3, 4]], "1 value rows but 2 id rows"),  # mismatched counts
        ([[-1.0, -2.0]], [[1.5, 2]], "integers"),  # non-integral id
        ([[-1.0, -2.0]], [[1, -3]], "outside"),  # negative id
        ([["a", "b"]], [[1, 2]], "values"),  # not numbers
        ([[NAN, -1.0]], [[1, 2]], "NaN"),  # partial NaN row
        ([[-1.0, -2.0]], [[True, False]], "ids"),  # booleans
        (np.zeros((2, 3)), np.zeros((2, 2), np.int32), "shape"),  # array of the wrong width
        ("rows", [[1, 2]], "sequence of rows"),
    ],
)
def test_rejections_raise_only_flat_logprobs_error(values, ids, match):
    with pytest.raises(FlatLogprobsError, match=match):
        build_flat_top_logprobs(values, ids, 2)


def test_interior_null_row_in_arrays_is_rejected():
    values = np.array([[-0.5, -0.7], [NAN, NAN], [-0.1, -0.2]], np.float32)
    ids = np.array([[1, 2], [-1, -1], [3, 4]], np.int32)
    with pytest.raises(FlatLogprobsError, match="row 1 is null"):
        build_flat_top_logprobs(values, ids, 2)


@pytest.mark.parametrize("k", [-1, 1.5, True, "2"])
def test_bad_k_is_rejected(k):
    with pytest.raises(FlatLogprobsError):
        build_flat_top_logprobs([], [], k)


def test_is_a_value_error():
    assert issubclass(FlatLogprobsError, ValueError)
