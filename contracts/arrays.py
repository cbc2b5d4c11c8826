"""How a numpy array travels: raw little-endian bytes plus dtype and shape.

Encoding copies the bytes once; decoding gives a `memoryview` into the received message, so
`np.frombuffer` over it is zero-copy (read-only, and it pins the message buffer). Conversion
helpers live in `services.common.arrays`, not here.
"""

from __future__ import annotations

import msgspec


class NDArray(msgspec.Struct, array_like=True, frozen=True, gc=False):
    dtype: str  # numpy `dtype.str`, always little-endian: "<f4", "<i4", "<i8", "|u1"
    shape: tuple[int, ...]
    data: memoryview  # row-major raw bytes, len == prod(shape) * itemsize
