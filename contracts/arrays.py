"""How a numpy array travels: raw little-endian bytes plus dtype and shape.

Encoding copies the bytes once; decoding gives a `memoryview` into the received message, so
`np.frombuffer` over it is zero-copy (read-only, and it pins the message buffer). Conversion
helpers live in `services.common.arrays`, not here.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from contracts.limits import MAX_ARRAY_DIMS, Dim

# numpy `dtype.str` of the dtypes that travel, always little-endian (or byte-sized).
WireDtype = Literal["<f2", "<f4", "<f8", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "|b1"]


class NDArray(msgspec.Struct, array_like=True, frozen=True, gc=False):
    dtype: WireDtype
    shape: Annotated[tuple[Dim, ...], msgspec.Meta(max_length=MAX_ARRAY_DIMS)]
    data: memoryview  # row-major raw bytes, len == prod(shape) * itemsize

    def __post_init__(self) -> None:
        """Invariant: the bytes are exactly the shape's (checked on decode too, so a reader's
        `np.frombuffer(...).reshape(shape)` cannot fail)."""
        expected = math.prod(self.shape) * int(self.dtype[2:])
        if memoryview(self.data).nbytes != expected:
            raise ValueError(f"array of shape {self.shape} and dtype {self.dtype} needs {expected} bytes")

    def is_vector(self, dtype: str, length: int | None = None) -> bool:
        """One-dimensional, of `dtype` (and `length`, when given)."""
        return self.dtype == dtype and len(self.shape) == 1 and length in (None, self.shape[0])
