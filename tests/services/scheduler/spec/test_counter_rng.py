"""Counter-based uniforms: seeded per row, batch-independent, uniform and uncorrelated."""

from __future__ import annotations

import torch

from services.scheduler.spec.counter_rng import MASK32, _mul32, fold_seed, seeded_uniforms
from tests.services.scheduler.spec.chi_square import chi_square_p_value


def test_a_row_depends_on_its_seed_only():
    batch = seeded_uniforms(torch.tensor([7, 123, 7]), 5)
    alone = seeded_uniforms(torch.tensor([123]), 5)
    assert torch.equal(batch[1], alone[0]) and torch.equal(batch[0], batch[2])
    assert not torch.equal(batch[0], batch[1])
    assert torch.equal(seeded_uniforms(torch.tensor([123]), 3)[0], alone[0, :3])  # a prefix of the same stream


def test_values_are_uniform_in_the_open_interval():
    u = seeded_uniforms(torch.arange(20_000), 10).flatten()  # consecutive seeds: the worst case for a weak mix
    assert 0.0 < u.min() and u.max() < 1.0
    bins = (u * 64).long()
    assert chi_square_p_value(bins, torch.full((64,), 1 / 64, dtype=torch.float64)) > 1e-4
    pairs = (u.view(-1, 2) * 8).long()  # joint of neighbouring counters, 64 cells
    assert chi_square_p_value(pairs[:, 0] * 8 + pairs[:, 1], torch.full((64,), 1 / 64, dtype=torch.float64)) > 1e-4


def test_neighbouring_seeds_and_counters_are_uncorrelated():
    u = seeded_uniforms(torch.arange(50_000), 2)  # [N, 2]
    across_seeds = torch.corrcoef(torch.stack((u[:-1, 0], u[1:, 0])))[0, 1]
    across_counters = torch.corrcoef(u.T)[0, 1]
    assert abs(across_seeds) < 0.02 and abs(across_counters) < 0.02


def test_mul32_is_multiplication_modulo_2_to_the_32():
    x = torch.tensor([0, 1, 0xFFFFFFFF, 0x12345678, 0xDEADBEEF])
    for constant in (0x85EBCA6B, 0xC2B2AE35, 3):
        assert _mul32(x, constant).tolist() == [(int(v) * constant) & MASK32 for v in x]


def test_any_python_int_folds_into_32_bits():
    for seed in (0, 1, -1, 2**63 - 1, -(2**63), 2**70 + 5):
        assert 0 <= fold_seed(seed) <= MASK32
    assert fold_seed(1) != fold_seed(2) and fold_seed(-1) != fold_seed(1)
