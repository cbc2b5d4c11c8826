"""The allocator settings the services apply at start."""

from __future__ import annotations

import subprocess
import sys

from services.common import memory


def test_glibc_accepts_the_thresholds_and_freed_large_blocks_stay_mapped():
    """In a fresh interpreter, the tokenizer's pattern per request: a 21 MB reassembly buffer and a
    28 MB response body, both touched, then freed. After the settings, repeating it must not fault
    the pages in again; with glibc's defaults a good part of them is faulted in anew every time."""
    script = """
import resource, sys
from services.common.memory import keep_large_buffers_mapped
tuned = sys.argv[1] == "tuned"
if tuned:
    assert keep_large_buffers_mapped()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def request():
    blocks = [bytearray(size) for size in (21_000_000, 28_000_000)]
    for block in blocks:
        block[::4096] = b"x" * len(block[::4096])
request()  # warm up
before = faults()
for _ in range(5):
    request()
print((faults() - before) // 5)
"""
    per_block = {}
    for mode in ("tuned", "default"):
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True)
        per_block[mode] = int(done.stdout)
    pages = 49_000_000 // 4096
    assert per_block["default"] > pages // 10  # the control (about 20% here)
    assert per_block["tuned"] < pages // 100  # 0 here


def test_thresholds_are_within_what_glibc_allows():
    assert memory.MMAP_THRESHOLD_BYTES <= 32 * 1024 * 1024  # mallopt refuses more on 64-bit
    assert memory.TRIM_THRESHOLD_BYTES >= memory.MMAP_THRESHOLD_BYTES
