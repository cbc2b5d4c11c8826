"""Pure formatting: scheduler arrays -> response fields, no NATS, no HTTP."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pybase64
import pytest

from services.common.logprob_rows import RequestLogprobs
from tests.logprob_entries import logprobs_of
from services.common.arrays import to_wire
from services.tokenizer.json_body import encode_json
from services.tokenizer.logprobs_format import FormatOptions, LogprobChunks
from services.tokenizer.logprobs_format import meta_logprobs as build_meta_logprobs
from services.tokenizer.openai_format import (
    chat_content,
    completion_logprobs,
    output_positions,
    prompt_positions,
    text_offsets,
)

NAN = float("nan")


def meta_logprobs(*args, **kwargs):
    """The fields as a client sees them: through JSON (triples may be tuples in memory)."""
    return msgspec.json.decode(encode_json(build_meta_logprobs(*args, **kwargs)))


def chunks_of(*messages: RequestLogprobs) -> LogprobChunks:
    chunks = LogprobChunks()
    for message in messages:
        chunks.add(message)
    return chunks


def f32(rows) -> object:
    return to_wire(np.array(rows, dtype="<f4"))


def i32(rows) -> object:
    return to_wire(np.array(rows, dtype="<i4"))


PROMPT = [11, 12, 13]
INPUT = logprobs_of(
    input_start=0,
    input_token_logprobs=f32([NAN, -1.5, -2.5]),
    input_top_logprobs=f32([[NAN, NAN], [-0.5, -1.5], [-0.25, -3.0]]),
    input_top_ids=i32([[-1, -1], [12, 40], [13, 7]]),
)
OUTPUT = logprobs_of(
    output_token_logprobs=f32([-0.75, -0.125]),
    output_top_logprobs=f32([[-0.75, -1.0], [-0.125, -4.0]]),
    output_top_ids=i32([[50, 51], [52, 53]]),
)


def test_triples_and_nan_is_null():
    meta = meta_logprobs(chunks_of(INPUT, OUTPUT), PROMPT, [50, 52], FormatOptions(top_logprobs_num=2))
    assert meta["input_token_logprobs"] == [[None, 11, None], [-1.5, 12, None], [-2.5, 13, None]]
    assert meta["input_top_logprobs"] == [None, [[-0.5, 12, None], [-1.5, 40, None]], [[-0.25, 13, None], [-3.0, 7, None]]]
    assert meta["output_token_logprobs"] == [[-0.75, 50, None], [-0.125, 52, None]]
    assert meta["output_top_logprobs"][1] == [[-0.125, 52, None], [-4.0, 53, None]]


def test_text_in_logprobs_and_defaults_off():
    opts = FormatOptions(text_of=lambda i: f"<{i}>")
    meta = meta_logprobs(chunks_of(INPUT, OUTPUT), PROMPT, [50, 52], opts)
    assert meta["output_token_logprobs"][0] == [-0.75, 50, "<50>"]
    # top_logprobs_num 0 and no token_ids_logprob: those fields are absent; no flat fields
    assert set(meta) == {"input_token_logprobs", "output_token_logprobs"}


def test_token_ids_logprob_rows():
    message = logprobs_of(input_start=1, input_token_logprobs=f32([-1.0]), input_ids_logprobs=f32([[-2.0, -3.0]]),
                              output_token_logprobs=f32([-0.5]), output_ids_logprobs=f32([[NAN, NAN]]))
    meta = meta_logprobs(chunks_of(message), PROMPT, [9], FormatOptions(token_ids_logprob=(4, 5)))
    assert meta["input_token_logprobs"] == [[-1.0, 12, None]]
    assert meta["input_token_ids_logprobs"] == [[[-2.0, 4, None], [-3.0, 5, None]]]
    assert meta["output_token_ids_logprobs"] == [None]


def test_chunks_concatenate_in_order():
    second = logprobs_of(output_token_logprobs=f32([-9.0]), output_top_logprobs=f32([[-9.0, -9.5]]), output_top_ids=i32([[1, 2]]))
    meta = meta_logprobs(chunks_of(OUTPUT, second), PROMPT, [50, 52, 1], FormatOptions(top_logprobs_num=2))
    assert [t[0] for t in meta["output_token_logprobs"]] == [-0.75, -0.125, -9.0]


FLAT = logprobs_of(
    input_start=0,
    input_token_logprobs=f32([NAN, -1.5, -2.5]),
    input_top_logprobs_flat=f32([[-0.5, -1.5], [-0.25, -3.0]]),
    input_top_ids_flat=i32([[12, 40], [13, 7]]),
    input_top_null_prefix=1,
)


def test_flat_lists():
    meta = meta_logprobs(chunks_of(FLAT), PROMPT, [], FormatOptions(top_logprobs_num=2, flat=True))
    assert "input_top_logprobs" not in meta
    assert meta["input_top_logprobs_shape"] == [2, 2]
    assert meta["input_top_logprobs_null_prefix"] == 1
    assert meta["input_top_logprobs_val_flat"] == [-0.5, -1.5, -0.25, -3.0]
    assert meta["input_top_logprobs_idx_flat"] == [12, 40, 13, 7]
    assert meta["output_top_logprobs"] == []  # output stays nested


def test_flat_b64_round_trip_little_endian():
    meta = meta_logprobs(chunks_of(FLAT), PROMPT, [], FormatOptions(top_logprobs_num=2, flat=True, flat_b64=True))
    values = np.frombuffer(pybase64.b64decode(meta["input_top_logprobs_val_flat_b64"]), dtype="<f4")
    ids = np.frombuffer(pybase64.b64decode(meta["input_top_logprobs_idx_flat_b64"]), dtype="<i4")
    assert values.tolist() == [-0.5, -1.5, -0.25, -3.0] and ids.tolist() == [12, 40, 13, 7]
    assert meta["input_top_logprobs_val_flat_b64_dtype"] == "float32"
    assert meta["input_top_logprobs_idx_flat_b64_dtype"] == "int32"
    assert "input_top_logprobs_val_flat" not in meta


def test_nested_rows_become_flat_when_no_arrays_came():
    meta = meta_logprobs(chunks_of(INPUT), PROMPT, [], FormatOptions(top_logprobs_num=2, flat=True))
    assert meta["input_top_logprobs_null_prefix"] == 1
    assert meta["input_top_logprobs_idx_flat"] == [12, 40, 13, 7]


def test_unrepresentable_rows_fall_back_to_nested():
    bad = logprobs_of(input_start=0, input_token_logprobs=f32([-1.0, NAN]),
                          input_top_logprobs=f32([[-0.5, -1.5], [NAN, NAN]]), input_top_ids=i32([[1, 2], [-1, -1]]))
    meta = meta_logprobs(chunks_of(bad), PROMPT, [], FormatOptions(top_logprobs_num=2, flat=True))
    assert meta["input_top_logprobs"] == [[[-0.5, 1, None], [-1.5, 2, None]], None]
    assert "input_top_logprobs_shape" not in meta


def test_arrays_arriving_after_a_nested_fallback_win():
    chunks = chunks_of(INPUT)  # nested rows first (fallback material) ...
    opts = FormatOptions(top_logprobs_num=2, flat=True)
    first = meta_logprobs(chunks, PROMPT, [], opts)
    later = logprobs_of(input_top_logprobs_flat=f32([[-7.0, -8.0], [-7.5, -8.5]]), input_top_ids_flat=i32([[1, 2], [3, 4]]),
                            input_top_null_prefix=1)
    chunks.add(later)  # ... then the scheduler's arrays
    meta = meta_logprobs(chunks, PROMPT, [], opts)
    assert first["input_top_logprobs_idx_flat"] == [12, 40, 13, 7]
    assert meta["input_top_logprobs_idx_flat"] == [1, 2, 3, 4]
    assert meta["input_top_logprobs_val_flat"] == [-7.0, -8.0, -7.5, -8.5]


@pytest.mark.parametrize(
    "pieces, expected",
    [
        ([b"ab", b"c", b" d"], [0, 2, 3]),
        (["é".encode()[:1], "é".encode()[1:], b"x"], [0, 0, 1]),
        (["你".encode(), b"", b"z"], [0, 1, 1]),
        ([], []),
    ],
)
def test_text_offsets(pieces, expected):
    assert text_offsets(pieces) == expected
    assert text_offsets(pieces, 10) == [10 + e for e in expected]


def test_echo_puts_prompt_first_with_null_head(text_model):
    prompt = text_model.encode("ab cd")
    out = [text_model.encode("x")[0]]
    message = logprobs_of(
        input_start=0,
        input_token_logprobs=f32([NAN] + [-1.0] * (len(prompt) - 1)),
        input_top_logprobs=f32([[NAN]] + [[-0.5]] * (len(prompt) - 1)),
        input_top_ids=i32([[-1]] + [[prompt[0]]] * (len(prompt) - 1)),
        output_token_logprobs=f32([-0.25]),
        output_top_logprobs=f32([[-0.25]]),
        output_top_ids=i32([out]),
    )
    chunks = chunks_of(message)
    positions = prompt_positions(chunks, prompt, 1) + output_positions(chunks, out, 1)
    visible = [text_model.token_bytes[i] for i in prompt + out]
    lp = completion_logprobs(positions, text_model, visible)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][-1] == -0.25
    assert "".join(lp["tokens"]) == "ab cdx"
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]


def test_chat_content_items_carry_bytes(text_model):
    ids = text_model.encode("é!")
    chunks = chunks_of(logprobs_of(output_token_logprobs=f32([-1.0] * len(ids)),
                                       output_top_logprobs=f32([[-1.0]] * len(ids)), output_top_ids=i32([[i] for i in ids])))
    items = chat_content(output_positions(chunks, ids, 1), text_model)
    assert b"".join(bytes(item["bytes"]) for item in items) == "é!".encode()
    assert all(item["top_logprobs"][0]["bytes"] == item["bytes"] for item in items)
    assert all(math.isclose(item["logprob"], -1.0) for item in items)


def _nested_and_flat(num_rows: int, k: int, seed: int) -> tuple[RequestLogprobs, RequestLogprobs]:
    """The same prompt top logprobs as nested rows (row 0 null) and as scheduler-built arrays."""
    from services.common.flat_logprobs import build_flat_top_logprobs

    rng = np.random.default_rng(seed)
    values = -np.sort(rng.random((num_rows, k), dtype=np.float32), axis=1)  # [P, k]
    ids = rng.integers(0, 2000, (num_rows, k)).astype(np.int32)  # [P, k]
    values[0], ids[0] = np.nan, -1
    token = np.full(num_rows, -1.0, np.float32)
    token[0] = np.nan
    nested = logprobs_of(input_start=0, input_token_logprobs=f32(token), input_top_logprobs=f32(values),
                             input_top_ids=i32(ids))
    flat = build_flat_top_logprobs(values, ids, k)
    arrays = logprobs_of(input_start=0, input_token_logprobs=f32(token), input_top_logprobs_flat=f32(flat.top_values),
                             input_top_ids_flat=i32(flat.top_ids), input_top_null_prefix=flat.start)
    return nested, arrays


@pytest.mark.parametrize("b64", [False, True])
@pytest.mark.parametrize("num_rows", [1, 2, 9])  # 1: every row null -> shape [0, k]
def test_array_path_equals_row_path_field_for_field(b64, num_rows):
    nested, arrays = _nested_and_flat(num_rows, 3, seed=num_rows)
    prompt = list(range(100, 100 + num_rows))
    opts = FormatOptions(top_logprobs_num=3, flat=True, flat_b64=b64)
    from_rows = meta_logprobs(chunks_of(nested), prompt, [], opts)
    from_arrays = meta_logprobs(chunks_of(arrays), prompt, [], opts)
    assert from_rows == from_arrays
    assert from_arrays["input_top_logprobs_shape"] == [num_rows - 1, 3]


@pytest.mark.parametrize("num_rows", [1, 8, 9, 300])
def test_top_rows_equal_one_row_at_a_time_with_nulls_gaps_and_nan(num_rows, text_model):
    # Each row as it reads alone: null rows, -1 gaps inside a row, NaN values, texts.
    from services.tokenizer.logprobs_format import top_rows

    def top_row(row_v, row_i, text_of):
        if all(i < 0 for i in row_i):
            return None
        return [(None if v != v else v, i, text_of(i) if text_of else None) for v, i in zip(row_v, row_i) if i >= 0]

    rng = np.random.default_rng(num_rows)
    values, ids = -rng.random((num_rows, 3)).astype(np.float32), rng.integers(0, 500, (num_rows, 3)).astype(np.int32)
    ids[::7] = -1  # null rows
    ids[3::11, 1:] = -1  # rows with fewer than k candidates
    values[5::13, 0] = np.nan
    for text_of in (None, text_model.token_text):
        want = [top_row(v, i, text_of) for v, i in zip(values.tolist(), ids.tolist())]
        assert top_rows(values, ids, text_of) == want
        assert encode_json(top_rows(values, ids, text_of)) == encode_json(want)
    assert top_rows(values[:, :0], ids[:, :0], None) == [None] * num_rows  # k = 0 reads as before: every row null


def test_top_rows_with_and_without_padding_read_the_same(text_model):
    # A step without padding takes the one-zip-per-row path; one padded id anywhere sends the whole
    # call down the filtering path: each row must come out the same either way.
    from services.tokenizer.openai_format import _positions

    rng = np.random.default_rng(7)
    top_v, top_i = -rng.random((6, 4)).astype(np.float32), rng.integers(0, 500, (6, 4)).astype(np.int32)
    values = -rng.random(6).astype(np.float32)
    plain = _positions(values, list(range(6)), top_v, top_i)
    padded_i = np.concatenate([top_i, np.full((1, 4), -1, np.int32)])  # a null row after the six
    padded = _positions(np.append(values, np.nan), list(range(7)), np.concatenate([top_v, top_v[:1]]), padded_i)
    assert padded.top[:6] == plain.top and padded.top[6] is None and padded.values[6] is None
    assert plain.top[2] == [(int(i), float(v)) for i, v in zip(top_i[2], top_v[2], strict=True)]
    partial_i = top_i.copy()
    partial_i[3, 2:] = -1  # fewer candidates than k in one row
    assert _positions(values, list(range(6)), top_v, partial_i).top[3] == plain.top[3][:2]


def test_token_labels_show_partial_utf8_as_bytes(text_model):
    from services.tokenizer.text_model import _label

    assert _label("é".encode()) == "é" and _label(b"ab") == "ab"
    assert _label("é".encode()[:1]) == "bytes:\\xc3"
    assert len(text_model.token_labels) == text_model.vocab_size
    assert all(label == _label(raw) for label, raw in zip(text_model.token_labels, text_model.token_bytes, strict=True))
    assert text_model.token_byte_lists[5] == tuple(text_model.token_bytes[5])


def test_the_tables_are_built_once_and_warming_builds_them(text_model):
    from services.tokenizer.text_model import TextModel

    fresh = TextModel(text_model.tokenizer, text_model.token_bytes, text_model.special_ids, text_model.vocab_size,
                      text_model.max_model_len, text_model.chat_template)  # fmt: skip
    assert "token_labels" not in fresh.__dict__
    fresh.warm_logprob_tables()
    labels = fresh.__dict__["token_labels"]
    assert fresh.token_labels is labels and len(fresh.token_byte_lists) == fresh.vocab_size


def test_text_offsets_agree_with_decoding_byte_by_byte():
    # The reference: decode the joined text and map every byte to the character that holds it.
    import random

    alphabet = [b"a", b" the", "é".encode(), "你".encode(), "é".encode()[:1], "é".encode()[1:], b"", "😀".encode()[:2],
                "😀".encode()[2:]]  # fmt: skip
    rng = random.Random(0)
    for _ in range(500):
        pieces = [rng.choice(alphabet) for _ in range(rng.randint(0, 10))]
        data = b"".join(pieces)
        char_of_byte, chars = [], 0
        for byte in data:
            chars += (byte & 0xC0) != 0x80
            char_of_byte.append(max(chars - 1, 0))
        starts = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
        want = [7 + (char_of_byte[s] if s < len(data) else chars) for s in starts]
        assert text_offsets(pieces, 7) == want, pieces


def test_a_streamed_result_keeps_counts_and_text_but_not_the_logprob_arrays():
    from types import SimpleNamespace

    from services.tokenizer.native import GenerationResult
    from services.tokenizer.requests import Delta

    logprobs = logprobs_of(output_token_logprobs=f32([-1.0, -2.0]), output_top_logprobs=f32([[-1.0], [-2.0]]),
                               output_top_ids=i32([[3], [4]]))  # fmt: skip
    delta = Delta("ab", [3, 4], 5, None, (logprobs,), None)
    kept = GenerationResult(SimpleNamespace(prompt_ids=(1,) * 5, stream=False))
    streamed = GenerationResult(SimpleNamespace(prompt_ids=(1,) * 5, stream=True))
    kept.add(delta)
    streamed.add(delta)
    assert (streamed.text, streamed.output_ids, streamed.prompt_tokens) == (kept.text, kept.output_ids, kept.prompt_tokens) == ("ab", [3, 4], 5)
    assert len(kept.chunks.output) == 1 and streamed.chunks.output == [] and streamed.chunks.prompt == []


@pytest.mark.parametrize("num_rows, k", [(1, 3), (300, 5), (40, 0)])
def test_openai_positions_equal_one_row_at_a_time(num_rows, k):
    # Each row must read as it would alone:
    # a row of -1 ids is null, -1 gaps are left out, k = 0 gives empty rows, ids shorter than values cut.
    from services.tokenizer.openai_format import _positions

    rng = np.random.default_rng(num_rows + k)
    values, top_v = -rng.random(num_rows).astype(np.float32), -rng.random((num_rows, k)).astype(np.float32)
    top_i = rng.integers(0, 500, (num_rows, k)).astype(np.int32)
    top_i[::9] = -1
    if k > 1:
        top_i[4::17, 1:] = -1
    ids = list(range(num_rows - 1)) if num_rows > 1 else [0]
    want = []
    for row_v, row_i in zip(top_v.tolist(), top_i.tolist()):
        null = bool(row_i) and all(i < 0 for i in row_i)
        want.append(None if null else [(i, v) for v, i in zip(row_v, row_i) if i >= 0])
    got = _positions(values, ids, top_v, top_i)
    assert got.top == want[: len(ids)] and got.ids == ids and len(got.values) == len(ids)


@pytest.mark.parametrize("b64", [False, True])
def test_streamed_flat_fields_only_in_the_event_with_rows(b64):
    opts = FormatOptions(top_logprobs_num=2, flat=True, flat_b64=b64, stream_event=True)
    later = meta_logprobs(chunks_of(OUTPUT), PROMPT, [50, 52], opts)  # an event after the prompt's
    assert not [key for key in later if key.startswith("input_top_logprobs")]
    first = meta_logprobs(chunks_of(FLAT, OUTPUT), PROMPT, [50, 52], opts)
    assert first["input_top_logprobs_shape"] == [2, 2] and first["input_top_logprobs_null_prefix"] == 1
    whole = meta_logprobs(chunks_of(OUTPUT), PROMPT, [50, 52], FormatOptions(top_logprobs_num=2, flat=True, flat_b64=b64))
    assert whole["input_top_logprobs_shape"] == [0, 2]  # a whole body keeps its (empty) fields


def test_accept_length_leaves_out_the_prefill_token():
    from services.tokenizer.native import accept_length

    assert accept_length(9, 2) == 4.0  # 1 token from the prefill + 2 verifies of 4
    assert accept_length(1, 0) == 0.0 and accept_length(0, 0) == 0.0
