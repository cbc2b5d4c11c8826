"""JSON response bodies whose large base64 fields skip msgspec's per-character string pass.

The flat b64 prompt logprobs of a 131072 x 20 request are two ~14 MB base64 strings. Encoding
them as Python `str` through `msgspec.json.encode` is slow (every character is checked for
escaping, and the output grows by reallocation); base64 text never needs escaping. Here such a
field is a `Base64Field` (the array itself): the rest of the body is encoded by msgspec with a
short marker string in its place, then the base64 text, made straight from the array's buffer by
pybase64, is joined in at the marker — one copy of the big text (`sparkwire bench
logprob-transport` reports both ways).
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
import numpy as np
import pybase64


class Base64Field:
    """A little-endian array that appears in a JSON body as the base64 of its bytes."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))

    def text(self) -> str:
        """The base64 text as a str (tests and small bodies)."""
        return pybase64.b64encode_as_string(self.array)

    def __repr__(self) -> str:
        return f"Base64Field({self.array.dtype.str}, shape={self.array.shape})"


def encode_json(body: Any) -> bytes:
    """`body` as JSON bytes, like `msgspec.json.encode`, with every `Base64Field` as a base64 string."""
    fields: list[Base64Field] = []
    nonce = ""  # drawn per call, at the first field: no user text can carry a marker by accident

    def marker(obj: Any) -> str:
        nonlocal nonce
        if isinstance(obj, Base64Field):
            nonce = nonce or secrets.token_hex(8)
            fields.append(obj)
            return f"sw-b64-{nonce}-{len(fields) - 1}"
        raise NotImplementedError(f"cannot encode {type(obj).__name__} as JSON")

    encoded = msgspec.json.Encoder(enc_hook=marker).encode(body)
    if not fields:
        return encoded  # the common case (every SSE event): no second pass
    parts: list[bytes] = []
    start = 0
    for index, field in enumerate(fields):
        token = f"sw-b64-{nonce}-{index}".encode()
        at = encoded.index(token, start)
        parts += [encoded[start:at], pybase64.b64encode(field.array)]
        start = at + len(token)
    parts.append(encoded[start:])
    return b"".join(parts)
