"""numpy <-> `contracts.arrays.NDArray`: little-endian raw bytes on every host."""

from __future__ import annotations

import numpy as np

from contracts.arrays import NDArray


def to_wire(array: np.ndarray) -> NDArray:
    """One copy at most (none if already contiguous little-endian)."""
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return NDArray(dtype=little.dtype.str, shape=tuple(little.shape), data=memoryview(little.reshape(-1)).cast("B"))


def from_wire(wire: NDArray) -> np.ndarray:
    """Zero-copy view over the message buffer (read-only). Converted to native order if needed."""
    dtype = np.dtype(wire.dtype)
    array = np.frombuffer(wire.data, dtype=dtype).reshape(wire.shape)
    return array if dtype.isnative else array.astype(dtype.newbyteorder("="))


def optional_to_wire(array: np.ndarray | None) -> NDArray | None:
    return None if array is None else to_wire(array)
