"""Block hashes of a token sequence: the prefix cache's keys and the placement summary's entries.

Block i's hash covers its `block_size` token ids and the hash of block i - 1, so equal hashes mean
equal prefixes; the chain starts from a salt (anything else that changes the KV: the weights'
version). blake2b over the bytes, not Python's `hash`, so the scheduler and the tokenizer (other
processes) compute the same values and a crafted prompt cannot collide with another's prefix
cheaply.
"""

from __future__ import annotations

import hashlib

import numpy as np

HASH_BYTES = 8  # an unsigned 64-bit int per block


def root_hash(salt: int) -> int:
    return _digest(salt.to_bytes(HASH_BYTES, "little", signed=True))


def extend_hashes(hashes: list[int], tokens: np.ndarray | list[int], block_size: int, salt: int) -> list[int]:
    """`hashes` (the chain over `tokens`' first full blocks) grown over every full block of `tokens`; in place."""
    num_full = len(tokens) // block_size
    if num_full <= len(hashes):
        return hashes
    parent = hashes[-1] if hashes else root_hash(salt)
    ids = np.asarray(tokens[len(hashes) * block_size : num_full * block_size], dtype="<i4")  # [new blocks * block_size]
    width = block_size * 4
    data = ids.tobytes()
    for offset in range(0, len(data), width):
        parent = _digest(parent.to_bytes(HASH_BYTES, "little") + data[offset : offset + width])
        hashes.append(parent)
    return hashes


def block_hashes(tokens: np.ndarray | list[int], block_size: int, salt: int) -> list[int]:
    """The chain over every full block of `tokens`."""
    return extend_hashes([], tokens, block_size, salt)


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=HASH_BYTES).digest(), "little")
