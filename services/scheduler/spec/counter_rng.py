"""Counter-based uniforms: u[b, i] is a pure function of (seed_b, i), computed with tensor ops.

Why not a torch.Generator per row: B generators mean B host-side seedings and B launches per
step, and a generator seeded inside a CUDA graph replays the captured seed. Here a row's numbers
depend on its seed alone (batch-independent), are identical on CPU and CUDA, and every op has a
static shape, so a graph can capture them with the seeds as an input tensor.

The hash is murmur3's 32-bit finalizer (a bijection of [0, 2^32) with full avalanche), applied
twice with two per-row keys; the 32-bit products are split in 16-bit halves so no int64 product
ever overflows. Two 32-bit words make one float64 uniform with 53 random bits, in (0, 1).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def fold_seed(seed: int) -> int:
    """Any Python int (negative or over 64 bits too) -> [0, 2^32), what `seeded_uniforms` takes."""
    folded = seed & ((1 << 64) - 1)
    return (folded ^ (folded >> 32)) & MASK32


def seeded_uniforms(seeds: torch.Tensor, num: int) -> torch.Tensor:
    """seeds int64 [B] in [0, 2^32) -> float64 [B, num], U(0, 1) exclusive of both ends."""
    key1 = _fmix32(seeds ^ 0x9E3779B9)[:, None]  # [B, 1]
    key2 = _fmix32(key1 ^ 0x632BE5AB)
    counters = torch.arange(2 * num, dtype=torch.int64, device=seeds.device)[None, :]  # [1, 2 * num]
    words = _fmix32(_fmix32(counters ^ key1) ^ key2).view(seeds.shape[0], num, 2)  # [B, num, 2]
    high, low = words[..., 0] >> 5, words[..., 1] >> 6  # 27 + 26 = 53 bits
    return ((high * (1 << 26) + low).double() + 0.5) / float(1 << 53)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for int64 x in [0, 2^32), with every partial product below 2^49."""
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (high + x * (constant & 0xFFFF)) & MASK32
