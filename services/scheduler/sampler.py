"""Sampling, vectorized over the rows that sample this step.

The draw is Gumbel-max in its exponential form: token = argmax(w_i / E_i) with E_i ~ Exp(1) i.i.d.,
which samples exactly from p = w / sum(w). The race runs on the unnormalised weights
w_i = exp(logit_i / T - max) (`sampling_weights`): no sum enters it, so vocabulary shards, whose
maximum is exact but whose sum adds in another order, draw bitwise the same id as whole rows
(`TensorParallel.sample`). E for a seeded request's output position i comes from a generator
seeded with mix(seed, i) alone, so the draw does not depend on which other requests share the
batch, nor on preemption and re-prefill. Requests without a seed get their generator seed from the
scheduler's own generator. Greedy rows (temperature 0) take the argmax of the raw logits, the
lowest token id on ties.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from contracts.scheduler import SamplingParams

MASK_63 = (1 << 63) - 1


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, output position), splitmix64 style."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & MASK_63


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    position: int  # output index of the token this row samples


ACCEPT_SALT = 0x5DEECE66D  # the accept test's uniforms use their own stream of the same key


class Sampler:
    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)  # seeds requests that bring none; per scheduler, not global

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """logits: f32 [B, V] -> token ids int64 [B], on the logits' device (no host sync)."""
        greedy_ids = logits.argmax(dim=-1)  # [B]
        temperatures = [row.params.temperature for row in rows]
        if all(t <= 0 for t in temperatures):
            return greedy_ids
        weights = sampling_weights(logits, [r.params for r in rows])  # [B, V]
        seeds = [self._seed(row) for row in rows]
        noise, _ = draw_noise(seeds, [row.position for row in rows], 0, logits.shape[1], logits.device)
        sampled = (weights / noise).argmax(dim=-1)  # [B]
        is_greedy = torch.tensor([t <= 0 for t in temperatures], device=logits.device)
        return torch.where(is_greedy, greedy_ids, sampled)

    def _seed(self, row: SampleRow) -> int | None:
        if row.params.temperature <= 0:
            return None
        return row.params.seed if row.params.seed is not None else self._rng.getrandbits(63)


def sampling_weights(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from, unnormalised: exp_from_max(logits / T), 0 where
    top-k/top-p/min-p drop a token. f32 [B, V]; p = w / w.sum(-1)."""
    device = logits.device
    temps = torch.tensor([max(p.temperature, 1e-6) for p in params], device=device)  # [B]
    weights = exp_from_max(logits / temps[:, None])  # [B, V]
    if all(unfiltered(p) for p in params):
        return weights
    filters = {name: torch.from_numpy(a).to(device) for name, a in filter_arrays(params).items()}
    return weights.masked_fill(filtered_out(weights, **filters), 0.0)


def exp_from_max(scaled: torch.Tensor, row_max: torch.Tensor | None = None) -> torch.Tensor:
    """exp(x - the row's maximum) [B, V]: softmax without its sum; each row's largest entry is exactly 1.
    row_max [B]: the whole row's maximum where `scaled` is one vocabulary shard of it (None: this row's)."""
    return torch.exp(scaled - (scaled.amax(dim=-1) if row_max is None else row_max)[:, None])


def draw_noise(
    seeds: list[int | None], positions: list[int], num_uniforms: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: Exp(1) noise [B, V] for a Gumbel-max draw and U(0, 1) uniforms [B, num_uniforms].

    Row i's values come from generators keyed by mix_seed(seeds[i], positions[i]) alone; a row with
    seed None (greedy) gets noise 1 and uniforms 0.
    """
    noise = torch.ones(len(seeds), vocab, device=device)  # [B, V]
    uniforms = torch.zeros(len(seeds), num_uniforms, device=device)  # [B, K]
    for index, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        if seed is None:
            continue
        key = mix_seed(seed, position)
        noise[index].exponential_(generator=_generator(key, device))
        if num_uniforms:
            uniforms[index].uniform_(generator=_generator(key ^ ACCEPT_SALT, device))
    return noise.clamp_min_(1e-30), uniforms  # E = 0 would turn p = 0 into 0/0


def _generator(key: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(key)
    return generator


TOP_K_OFF = np.iinfo(np.int64).max  # keeps every rank


def filter_arrays(params: list[SamplingParams]) -> dict[str, np.ndarray]:
    """Per row, what `filtered_out` reads: top_k int64 [B] (TOP_K_OFF: off), top_p f32 [B], min_p f32 [B]."""
    return {
        "top_k": np.asarray([p.top_k if p.top_k > 0 else TOP_K_OFF for p in params], np.int64),
        "top_p": np.asarray([p.top_p for p in params], np.float32),
        "min_p": np.asarray([p.min_p for p in params], np.float32),
    }


def filtered_out(weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """weights f32 [B, V] (`exp_from_max` after temperature) -> bool [B, V]: the tokens each row's top-k,
    top-p and min-p (`filter_arrays`) remove. The token whose cumulative mass crosses top_p of the row's
    total is kept; ties keep the lower id."""
    vocab = weights.shape[1]
    sorted_w, order = weights.sort(dim=-1, descending=True, stable=True)  # [B, V]
    ranks = torch.arange(vocab, device=weights.device)  # [V]
    mass = sorted_w.cumsum(dim=-1)  # [B, V]
    drop = ranks[None, :] >= top_k[:, None]
    drop |= mass - sorted_w > top_p[:, None] * mass[:, -1:]
    drop |= sorted_w < min_p[:, None] * sorted_w[:, :1]
    return torch.zeros_like(drop).scatter_(1, order, drop)


def unfiltered(params: SamplingParams) -> bool:
    return params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0
