"""Rotary position embeddings: every RoPE type the supported families' published configs use.

Each type is a function of the config alone giving (inverse frequencies [D/2] fp32, attention
factor), as `transformers.modeling_rope_utils` computes them; cos and sin are multiplied by the
factor before they round to the model's dtype (YaRN's mscale, LongRoPE's scaling), as there.

- default, linear (positions / factor), llama3 (wavelength bands), yarn (ramp between
  interpolation and extrapolation, `beta_fast` / `beta_slow`, mscale): fixed frequencies.
- longrope (Phi-3): transformers picks the long factors for a forward whose sequence is longer
  than `original_max_position_embeddings`, else the short ones. A paged cache keeps the keys of a
  whole sequence, so the set is chosen once per server from the context it serves
  (`ModelConfig.context_len`, `--max-model-len`): the long set past the original context.
- dynamic (NTK): transformers raises the base with each forward's length past
  `max_position_embeddings`; within it the frequencies are the default ones. Cached keys cannot
  follow a base that moves, so a dynamic config is served exactly up to `max_position_embeddings`
  and refused past it (`ModelConfig`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """A config's `rope_scaling` (or `rope_parameters`); fields past `original_max_position_embeddings`
    belong to yarn and longrope. `rope_type` "default" means none."""

    rope_type: str = "default"
    factor: float | None = None  # None: max_position_embeddings / original (yarn, longrope)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: correction range rounded outwards
    attention_factor: float | None = None  # yarn, longrope; None: derived from factor
    short_factor: tuple[float, ...] = ()  # longrope [D/2]
    long_factor: tuple[float, ...] = ()  # longrope [D/2]


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """theta ** (-2i / D) for i < D/2, fp32 [D/2]."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_frequencies(
    scaling: RopeScaling | None, theta: float, head_dim: int, max_position_embeddings: int, context_len: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies fp32 [D/2], attention factor) of one RoPE; context_len: the longest
    sequence served (longrope's choice of factors)."""
    if scaling is None or scaling.rope_type in ("default", "dynamic"):
        return default_inv_freq(theta, head_dim), 1.0
    if scaling.rope_type == "linear":
        return default_inv_freq(theta, head_dim) / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3_scale(default_inv_freq(theta, head_dim), scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(scaling, theta, head_dim, max_position_embeddings)
    if scaling.rope_type == "longrope":
        return _longrope(scaling, theta, head_dim, max_position_embeddings, context_len)
    raise ValueError(f"unknown rope_type {scaling.rope_type!r}")


def _llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(scaling: RopeScaling, theta: float, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    # Dimensions that turn fewer than beta_slow times over the original context are interpolated
    # (divided by factor), those turning more than beta_fast times kept, a linear ramp between.
    original = scaling.original_max_position_embeddings
    factor = scaling.factor or max_position_embeddings / original
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # [D/2]
    low, high = _yarn_correction_range(scaling, theta, head_dim, original)
    extrapolated = 1 - _linear_ramp(low, high, head_dim // 2)  # [D/2], 1: keep the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, _yarn_attention_factor(scaling, factor)


def _yarn_attention_factor(scaling: RopeScaling, factor: float) -> float:
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(factor, scaling.mscale) / yarn_mscale(factor, scaling.mscale_all_dim)
    return yarn_mscale(factor)


def _yarn_correction_range(scaling: RopeScaling, theta: float, head_dim: int, original: int) -> tuple[float, float]:
    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _linear_ramp(low: float, high: float, size: int) -> torch.Tensor:
    high = high + 0.001 if low == high else high  # no division by zero
    return ((torch.arange(size, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)


def _longrope(
    scaling: RopeScaling, theta: float, head_dim: int, max_position_embeddings: int, context_len: int
) -> tuple[torch.Tensor, float]:
    original = scaling.original_max_position_embeddings
    factor = scaling.factor if scaling.factor is not None else max_position_embeddings / original
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = scaling.long_factor if context_len > original else scaling.short_factor
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta**exponents), attention_factor


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, attention_factor: float = 1.0
) -> tuple[torch.Tensor, ...]:
    """(cos, sin) [T, 1, D] at positions [T], scaled by the attention factor in fp32, then rounded to dtype."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; rotate-half convention of the Hugging Face checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)
