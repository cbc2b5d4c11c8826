"""Long-query attention on FlashAttention-4's CuTe kernels (the `flash-attn-4` package, module
`flash_attn.cute`): the second kernel of the dense path (`dense_attention.py`,
`DenseConfig.kernel == "flash4"`), which `build_core` takes where it can run.

Faster than cuDNN through SDPA on a long prompt's layers, it also drops the two calls merged by
log-sum-exp for a query with context (the second 16k step of a 32k prompt): its causal mask is
lower-right aligned, so query i of q sees keys 0 .. L - q + i in one call. Queries, keys and
output are in the step's own row layout ([T, H, D], BSHD), so nothing is transposed. The K/V are
the dense path's contiguous gather: FA4 reading the 16-token pages in place (its `page_table`) was
slower, and as 128-token pages (one a key tile, its TMA path) no faster.

The package is optional (`pip install -e '.[flash4]'` from a checkout): it needs CUDA on compute
capability 9.x (Hopper, its SM90 forward) or 10.x, and JIT-compiles each kernel variant on first
use (seconds each, so `warm_flash4` does it at start-up; a new length does not compile again).
`flash4_unavailable` says why it cannot run here, or None. CI has no GPU: the CPU tests cover the
choice, and `sparkwire bench gpu-kernels prefill-attention` checks its output against the varlen
kernel's on a GPU.
"""

from __future__ import annotations

import importlib.util

import torch

FLASH4_MODULE = "flash_attn.cute"
FLASH4_CAPABILITIES = (9, 10)  # compute capability majors with an FA4 forward kernel here (SM90, SM100)


def flash4_unavailable(device: torch.device) -> str | None:
    """Why FA4 cannot attend on this device, or None when it can."""
    if device.type != "cuda":
        return f"flash4 needs CUDA, not {device.type}"
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec(FLASH4_MODULE) is None:
        return "flash4 is not installed (pip install -e '.[flash4]')"
    if not torch.cuda.is_available():
        return "flash4 needs CUDA, and this torch has none"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FLASH4_CAPABILITIES:
        return f"flash4 has no forward kernel for compute capability {major}.{minor} (needs {FLASH4_CAPABILITIES}.x)"
    return None


def attend_sequence_flash4(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Lower-right causal attention of one sequence's last q positions: query [q, Hq, D] over its
    contiguous keys and values [L, Hkv, D] (L >= q) -> [q, Hq, D]."""
    from flash_attn.cute import flash_attn_func

    return flash4_output(flash_attn_func(query[None], keys[None], values[None], softmax_scale=scale, causal=True))[0]


def flash4_output(result) -> torch.Tensor:
    """The attention output of an FA4 call, which returns it alone or as (out, lse)."""
    return result[0] if isinstance(result, tuple) else result


def warm_flash4(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """Compile the kernel variants the dense path launches (a square prompt, a query with context)
    on a small sequence, so that the first long prompt does not pay the JIT."""
    keys = torch.zeros(256, kv_heads, head_dim, device=device, dtype=dtype)
    for q_len in (256, 128):  # no context, then context
        query = torch.zeros(q_len, heads, head_dim, device=device, dtype=dtype)
        attend_sequence_flash4(query, keys, keys, head_dim**-0.5)
