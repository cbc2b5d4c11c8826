"""Process-wide memory settings of the services: glibc's allocator thresholds (multi-MB messages)
and CPython's garbage collector (per-step objects).

A first touch of a fresh 4 KiB page is a page fault, so a copy into a fresh multi-MB buffer costs
many times the same copy into reused memory. glibc serves blocks above its mmap threshold
(dynamic, 128 KiB at start) with a fresh `mmap` and unmaps them on free, and trims the heap top
when more than the trim threshold is free, so the buffers of every large message (a reassembled
131072 x 20 prompt-logprob message, a 28 MB response body) are faulted in again and again.
`sparkwire bench logprob-transport` runs the HTTP path both ways: with these settings the
tokenizer takes far fewer page faults and less CPU per such request than with glibc's defaults.
Raising both thresholds keeps freed large blocks in the heap for reuse: page faults are paid once
per high-water mark, not once per message.

The collector: CPython runs a young collection once 700 more container objects are alive than
at the last one. A scheduler decode step makes a few short-lived objects per request (queries,
entries, outputs): with top-20 output logprobs that crossed 700 at batch 64 almost every step
(before a request's rows became one `RowSpan`; at batch 128 it still does about every other step,
`tests/services/scheduler/test_collector.py`), each collection adding host time to the step, and
every collection that reaches the oldest generation walks the whole heap (~310,000 objects after
torch's import): a pause that shows in every stream. `collector_tuned` raises the young threshold
so that the step's objects are freed by their reference counts before any collection sees them,
and `settle_startup_heap` moves what start-up made (modules, the model, compiled kernels) out of
the collector's reach once a service is ready (`gc.freeze`), as vLLM and SGLang do after start-up.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
from collections.abc import Iterator

import structlog

log = structlog.get_logger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD_BYTES = 512 * 1024 * 1024  # freed heap kept mapped, up to this much

COLLECTOR_MODES = ("tuned", "default")
YOUNG_COLLECTION_THRESHOLD = 20_000  # CPython's default is 700


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


@contextlib.contextmanager
def collector_tuned() -> Iterator[None]:
    """While inside: young collections only once 20,000 more container objects are alive (the
    older generations' thresholds unchanged). On leaving: CPython's thresholds as they were, and
    anything `settle_startup_heap` froze back in the collector's reach."""
    saved = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *saved[1:])
    try:
        yield
    finally:
        gc.set_threshold(*saved)
        gc.unfreeze()


def collections_since_start() -> list[int]:
    """The garbage collector's runs so far in this process, per generation (young first): what a
    service reports when it stops."""
    return [generation["collections"] for generation in gc.get_stats()]


def settle_startup_heap() -> int:
    """Once a service is ready: with the collector tuned (`collector_tuned`), collect once, then
    freeze every object alive (`gc.freeze`: later collections skip them). Returns how many were
    frozen; 0, and nothing done, where the collector is CPython's own (`SPARKWIRE_COLLECTOR=default`)."""
    if gc.get_threshold()[0] != YOUNG_COLLECTION_THRESHOLD:
        return 0
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("memory.startup_heap_frozen", objects=frozen)
    return frozen
