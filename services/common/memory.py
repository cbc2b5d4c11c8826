"""Process-wide allocator settings for services that move multi-MB messages.

On the 2-core machine a first touch of a fresh 4 KiB page costs ~6 us (a fresh 21 MB buffer
filled by one copy took ~31 ms, the same copy into reused memory ~1 ms). glibc serves blocks
above its mmap threshold (dynamic, 128 KiB at start) with a fresh `mmap` and unmaps them on free,
and trims the heap top when more than the trim threshold is free, so the buffers of every large
message (a reassembled 131072 x 20 prompt-logprob message, a 28 MB response body) are faulted in
again and again. `sparkwire bench logprob-transport` runs the HTTP path both ways: with glibc's
defaults the tokenizer took 14,939 page faults and 158.6 ms of CPU per such request, with these
settings 880 and 111.4 ms. Raising both thresholds keeps freed large blocks in the heap for
reuse: page faults are paid once per high-water mark, not once per message.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import structlog

log = structlog.get_logger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD_BYTES = 512 * 1024 * 1024  # freed heap kept mapped, up to this much


def keep_large_buffers_mapped() -> bool:
    """Serve blocks up to 32 MiB from the heap and keep up to 512 MiB of freed heap mapped.
    Returns False (and changes nothing) where the C library is not glibc."""
    path = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(path).mallopt if path else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.info("memory.allocator_untuned", reason="no glibc mallopt")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not applied:
        log.warning("memory.allocator_untuned", reason="mallopt refused the thresholds")
    return applied
