"""`encode_json`: msgspec JSON with `Base64Field` values joined in as base64 text."""

from __future__ import annotations

import msgspec
import numpy as np
import pybase64
import pytest

from services.tokenizer.json_body import Base64Field, encode_json


def test_without_fields_it_is_msgspec_json():
    body = {"text": "caf\u00e9 \"quoted\"\n", "ids": [1, 2], "meta": {"x": None, "y": 1.5}}
    assert encode_json(body) == msgspec.json.encode(body)


def test_fields_become_base64_of_little_endian_bytes_in_place():
    values = np.arange(6, dtype=">f4").reshape(2, 3)  # big-endian input still leaves as little-endian
    ids = np.array([[7, -1], [3, 2**31 - 1]], dtype="<i4")
    body = {"a": 1, "meta": {"val": Base64Field(values), "n": [Base64Field(ids), "tail"]}, "z": "end"}
    decoded = msgspec.json.decode(encode_json(body))
    assert decoded["a"] == 1 and decoded["z"] == "end" and decoded["meta"]["n"][1] == "tail"
    assert pybase64.b64decode(decoded["meta"]["val"]) == np.arange(6, dtype="<f4").tobytes()
    assert pybase64.b64decode(decoded["meta"]["n"][0]) == ids.tobytes()
    assert decoded["meta"]["val"] == Base64Field(values).text()


def test_user_text_that_looks_like_a_marker_is_left_alone():
    body = {"text": "sw-b64-0000000000000000-0", "val": Base64Field(np.ones(2, "<f4")), "after": "sw-b64-"}
    decoded = msgspec.json.decode(encode_json(body))
    assert decoded["text"] == "sw-b64-0000000000000000-0" and decoded["after"] == "sw-b64-"
    assert pybase64.b64decode(decoded["val"]) == np.ones(2, "<f4").tobytes()


def test_empty_array_is_an_empty_string():
    assert msgspec.json.decode(encode_json({"v": Base64Field(np.empty((0, 20), "<f4"))})) == {"v": ""}


def test_other_types_are_refused():
    with pytest.raises(NotImplementedError, match="object"):
        encode_json({"x": object()})
