"""Sampling, vectorized over the rows that sample this step.

The draw is Gumbel-max in its exponential form: token = argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d.,
which samples exactly from p. E for a seeded request's output position i comes from a generator
seeded with mix(seed, i) alone, so the draw does not depend on which other requests share the
batch, nor on preemption and re-prefill. Requests without a seed get their generator seed from the
scheduler's own generator. Greedy rows (temperature 0) take the argmax of the raw logits, the
lowest token id on ties.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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


class Sampler:
    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)  # seeds requests that bring none; per scheduler, not global

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """logits: f32 [B, V] -> token ids int64 [B], on the logits' device (no host sync)."""
        greedy_ids = logits.argmax(dim=-1)  # [B]
        temperatures = [row.params.temperature for row in rows]
        if all(t <= 0 for t in temperatures):
            return greedy_ids
        probs = self._filtered_probs(logits, rows)  # [B, V]
        noise = self._exponential_noise(rows, logits.shape[1], logits.device)  # [B, V]
        sampled = (probs / noise).argmax(dim=-1)  # [B]
        is_greedy = torch.tensor([t <= 0 for t in temperatures], device=logits.device)
        return torch.where(is_greedy, greedy_ids, sampled)

    def _filtered_probs(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([max(r.params.temperature, 1e-6) for r in rows], device=device)  # [B]
        probs = torch.softmax(logits / temps[:, None], dim=-1)  # [B, V]
        if all(unfiltered(r.params) for r in rows):
            return probs
        return probs.masked_fill(filtered_out(probs, [r.params for r in rows]), 0.0)

    def _exponential_noise(self, rows: list[SampleRow], vocab: int, device: torch.device) -> torch.Tensor:
        noise = torch.empty(len(rows), vocab, device=device)  # [B, V]
        for index, row in enumerate(rows):
            if row.params.temperature <= 0:
                noise[index] = 1.0
                continue
            seed = row.params.seed if row.params.seed is not None else self._rng.getrandbits(63)
            generator = torch.Generator(device=device)
            generator.manual_seed(mix_seed(seed, row.position))
            noise[index].exponential_(generator=generator)
        return noise.clamp_min_(1e-30)  # E = 0 would turn p = 0 into 0/0


def filtered_out(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """probs f32 [B, V] (after temperature) -> bool [B, V]: the tokens each row's top-k, top-p
    and min-p remove. The token whose cumulative mass crosses top_p is kept; ties keep the lower id."""
    device, vocab = probs.device, probs.shape[1]
    top_k = torch.tensor([_top_k(p, vocab) for p in params], device=device)  # [B]
    top_p = torch.tensor([p.top_p for p in params], device=device)  # [B]
    min_p = torch.tensor([p.min_p for p in params], device=device)  # [B]
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # [B, V]
    ranks = torch.arange(vocab, device=device)  # [V]
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # [B, V]
    drop = ranks[None, :] >= top_k[:, None]
    drop |= mass_before > top_p[:, None]
    drop |= sorted_p < min_p[:, None] * sorted_p[:, :1]
    return torch.zeros_like(drop).scatter_(1, order, drop)


def _top_k(params: SamplingParams, vocab: int) -> int:
    return vocab if params.top_k <= 0 else min(params.top_k, vocab)


def unfiltered(params: SamplingParams) -> bool:
    return params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0
