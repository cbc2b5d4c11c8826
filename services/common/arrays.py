"""numpy <-> `contracts.arrays.NDArray`: little-endian raw bytes on every host."""

from __future__ import annotations

import sys

import numpy as np

from contracts.arrays import NDArray

# byte orders whose bytes already travel as they are: little-endian, byte-sized, and native on a little-endian host
_WIRE_ORDERS = frozenset("<|=" if sys.byteorder == "little" else "<|")


def to_wire(array: np.ndarray) -> NDArray:
    """One copy at most (none if already contiguous little-endian: the NDArray then views `array`)."""
    if not (array.flags.c_contiguous and array.dtype.byteorder in _WIRE_ORDERS):
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return NDArray(dtype=array.dtype.str, shape=array.shape, data=memoryview(array.reshape(-1)).cast("B"))


def from_wire(wire: NDArray) -> np.ndarray:
    """Zero-copy view over the message buffer (read-only). Converted to native order if needed."""
    dtype = np.dtype(wire.dtype)
    array = np.frombuffer(wire.data, dtype=dtype).reshape(wire.shape)
    return array if dtype.isnative else array.astype(dtype.newbyteorder("="))


def optional_to_wire(array: np.ndarray | None) -> NDArray | None:
    return None if array is None else to_wire(array)
