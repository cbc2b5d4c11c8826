"""numpy <-> `contracts.arrays.NDArray`: little-endian raw bytes on every host."""

from __future__ import annotations

import sys
from typing import get_args

import numpy as np

from contracts.arrays import NDArray, WireDtype

# byte orders whose bytes already travel as they are: little-endian, byte-sized, and native on a little-endian host
_WIRE_ORDERS = frozenset("<|=" if sys.byteorder == "little" else "<|")
_WIRE_NAMES = {np.dtype(name): name for name in get_args(WireDtype)}  # dtype -> its `dtype.str`, without building it


def to_wire(array: np.ndarray) -> NDArray:
    """One copy at most (none if already contiguous little-endian: the NDArray then views `array`).
    Called per logprob array per request per step, so the view costs only what it must."""
    if not (array.flags.c_contiguous and array.dtype.byteorder in _WIRE_ORDERS):
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    data = array.data.cast("B") if array.size else memoryview(b"")  # a view with a 0 in its shape cannot be cast
    return NDArray(dtype=_WIRE_NAMES.get(array.dtype) or array.dtype.str, shape=array.shape, data=data)


def from_wire(wire: NDArray) -> np.ndarray:
    """Zero-copy view over the message buffer (read-only). Converted to native order if needed."""
    dtype = np.dtype(wire.dtype)
    array = np.frombuffer(wire.data, dtype=dtype).reshape(wire.shape)
    return array if dtype.isnative else array.astype(dtype.newbyteorder("="))

